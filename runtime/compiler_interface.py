"""The runtime's interface for the compile side: what ``precompile`` builds artifacts and
models against (the store's entry points, the manifest's parts, the guard and cache
schemas). Only the compile side imports it; a serving process never needs it, and
users see ``precompile.runtime``, whose ``__all__`` does not list these names.

Lazy like the package (PEP 562): a name costs its module's import on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr

if TYPE_CHECKING:
    from ._binary_format import read_binary, sign_binary
    from ._build_dir import build_dir
    from ._cached import load_cached as load_cached_artifact
    from ._cached import load_cached_model, store_artifact, store_model
    from ._calibration import synthesize_inputs
    from ._cudagraphs import CudaGraphsOption, cudagraph_options
    from ._dispatch import Dispatcher
    from ._dtypes import dtype_name
    from ._entry_summary import (
        ABOUT_BLOCKS,
        ABOUT_CONFIG,
        ABOUT_GRAPH,
        EntrySummary,
        summarize_entry,
    )
    from ._environment import current_environment
    from ._global_state import describe as describe_global_state
    from ._global_state import trace_state
    from ._kv_cache import CacheLayout as KVCacheLayout
    from ._kv_cache import (
        KVCacheKind,
        is_kv_cache,
        kv_cache_capacities,
        kv_cache_capacity,
        kv_cache_kind,
    )
    from ._kv_cache import cache_tensors as kv_cache_tensors
    from ._kv_cache import counter_values as kv_cache_counter_values
    from ._kv_cache import describe_cache as describe_kv_cache
    from ._lean import load_lean
    from ._manifest import (
        FORMAT_VERSION,
        InputSpec,
        IntInput,
        ProcessGroupSpec,
        TensorInput,
        TritonLaunch,
    )
    from ._model import ModelPlan, hooks_on
    from ._model import stale_reason as plan_stale_reason
    from ._model_guards import Guard, TraceRead, Unencodable, qualified_name, traced_forward
    from ._model_guards import Roots as GuardRoots
    from ._model_guards import dict_keys as guarded_dict_keys
    from ._model_guards import encode as encode_guard_value
    from ._model_guards import named as guard_identity
    from ._model_guards import readable as readable_guard_expr
    from ._model_guards import roots_of as guard_roots
    from ._model_identity import (
        NO_FILE,
        canonical_digest,
        class_path,
        code_digest,
        file_digest,
        fileless_functions,
        model_identity,
    )
    from ._native_kernels import cpu_features_for_flags, find_cpp_kernels
    from ._native_kernels import kernel_key as native_kernel_key
    from ._payloads import MemoryPayloads
    from ._process_groups import describe_groups as describe_process_groups
    from ._process_groups import registered_groups as registered_process_groups
    from ._process_groups import this_rank
    from ._relocate import dotted_name, move_refusal
    from ._torch_adapter import tree_flatten, tree_unflatten, treespec_to_json
    from ._unbound import UnboundTensor
    from ._unpacked_format import read_unpacked, sign_unpacked

_LAZY = {
    "ABOUT_BLOCKS": "._entry_summary",
    "ABOUT_CONFIG": "._entry_summary",
    "ABOUT_GRAPH": "._entry_summary",
    "CudaGraphsOption": "._cudagraphs",
    "EntrySummary": "._entry_summary",
    "FORMAT_VERSION": "._manifest",
    "Guard": "._model_guards",
    "GuardRoots": "._model_guards:Roots",
    "InputSpec": "._manifest",
    "IntInput": "._manifest",
    "KVCacheLayout": "._kv_cache:CacheLayout",
    "KVCacheKind": "._kv_cache",
    "kv_cache_capacities": "._kv_cache",
    "kv_cache_kind": "._kv_cache",
    "MemoryPayloads": "._payloads",
    "ModelPlan": "._model",
    "ProcessGroupSpec": "._manifest",
    "TensorInput": "._manifest",
    "TraceRead": "._model_guards",
    "UnboundTensor": "._unbound",
    "TritonLaunch": "._manifest",
    "Unencodable": "._model_guards",
    "build_dir": "._build_dir",
    "canonical_digest": "._model_identity",
    "class_path": "._model_identity",
    "cpu_features_for_flags": "._native_kernels",
    "cudagraph_options": "._cudagraphs",
    "current_environment": "._environment",
    "describe_global_state": "._global_state:describe",
    "describe_kv_cache": "._kv_cache:describe_cache",
    "describe_process_groups": "._process_groups:describe_groups",
    "Dispatcher": "._dispatch",
    "dtype_name": "._dtypes",
    "encode_guard_value": "._model_guards:encode",
    "file_digest": "._model_identity",
    "fileless_functions": "._model_identity",
    "code_digest": "._model_identity",
    "NO_FILE": "._model_identity",
    "find_cpp_kernels": "._native_kernels",
    "guard_identity": "._model_guards:named",
    "guard_roots": "._model_guards:roots_of",
    "guarded_dict_keys": "._model_guards:dict_keys",
    "hooks_on": "._model",
    "is_kv_cache": "._kv_cache",
    "kv_cache_capacity": "._kv_cache",
    "kv_cache_counter_values": "._kv_cache:counter_values",
    "kv_cache_tensors": "._kv_cache:cache_tensors",
    "load_cached_artifact": "._cached:load_cached",
    "load_cached_model": "._cached",
    "load_lean": "._lean",
    "model_identity": "._model_identity",
    "native_kernel_key": "._native_kernels:kernel_key",
    "plan_stale_reason": "._model:stale_reason",
    "qualified_name": "._model_guards",
    "read_binary": "._binary_format",
    "read_unpacked": "._unpacked_format",
    "readable_guard_expr": "._model_guards:readable",
    "registered_process_groups": "._process_groups:registered_groups",
    "sign_binary": "._binary_format",
    "sign_unpacked": "._unpacked_format",
    "dotted_name": "._relocate",
    "move_refusal": "._relocate",
    "store_artifact": "._cached",
    "store_model": "._cached",
    "summarize_entry": "._entry_summary",
    "synthesize_inputs": "._calibration",
    "this_rank": "._process_groups",
    "trace_state": "._global_state",
    "traced_forward": "._model_guards",
    "tree_flatten": "._torch_adapter",
    "tree_unflatten": "._torch_adapter",
    "treespec_to_json": "._torch_adapter",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals(), anchor=__package__)

__all__ = [
    "ABOUT_BLOCKS",
    "ABOUT_CONFIG",
    "ABOUT_GRAPH",
    "CudaGraphsOption",
    "Dispatcher",
    "EntrySummary",
    "FORMAT_VERSION",
    "Guard",
    "GuardRoots",
    "InputSpec",
    "IntInput",
    "KVCacheKind",
    "KVCacheLayout",
    "MemoryPayloads",
    "ModelPlan",
    "ProcessGroupSpec",
    "TensorInput",
    "TraceRead",
    "TritonLaunch",
    "UnboundTensor",
    "Unencodable",
    "build_dir",
    "canonical_digest",
    "class_path",
    "cpu_features_for_flags",
    "cudagraph_options",
    "current_environment",
    "describe_global_state",
    "describe_kv_cache",
    "describe_process_groups",
    "dotted_name",
    "dtype_name",
    "encode_guard_value",
    "file_digest",
    "fileless_functions",
    "code_digest",
    "NO_FILE",
    "find_cpp_kernels",
    "guard_identity",
    "guard_roots",
    "guarded_dict_keys",
    "hooks_on",
    "is_kv_cache",
    "kv_cache_capacities",
    "kv_cache_capacity",
    "kv_cache_counter_values",
    "kv_cache_kind",
    "kv_cache_tensors",
    "load_cached_artifact",
    "load_cached_model",
    "load_lean",
    "model_identity",
    "move_refusal",
    "native_kernel_key",
    "plan_stale_reason",
    "qualified_name",
    "read_binary",
    "read_unpacked",
    "readable_guard_expr",
    "registered_process_groups",
    "sign_binary",
    "sign_unpacked",
    "store_artifact",
    "store_model",
    "summarize_entry",
    "synthesize_inputs",
    "this_rank",
    "trace_state",
    "traced_forward",
    "tree_flatten",
    "tree_unflatten",
    "treespec_to_json",
]
