"""The cache key of a graph (`cache_factors`) and of a whole model (`model_factors`,
computed without tracing): everything that changes the compiled code, and nothing else.

Each factor is kept by name in the cache entry, so a miss can say which factor
differs from the nearest existing entry. Paths, pids and timestamps never enter it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from precompile.cache import LAYOUT
from precompile.runtime import __version__
from precompile.runtime.compiler_interface import (
    FORMAT_VERSION,
    current_environment,
    dtype_name,
    is_kv_cache,
    kv_cache_kind,
    model_identity,
    this_rank,
    trace_state,
    tree_flatten,
)
from precompile.runtime.compiler_interface import canonical_digest as _digest
from precompile.runtime.compiler_interface import describe_global_state as describe_state
from precompile.runtime.compiler_interface import describe_kv_cache as describe_cache
from precompile.runtime.compiler_interface import registered_process_groups as registered_groups

from ._compiler_config import codegen_config_digest
from ._gemm_policy import POLICY as GEMM_POLICY
from ._graph import BACKWARD_POLICY, GraphDescription, has_backward
from ._kernel_checks import MARK as KERNELS
from ._precision_policy import POLICY as PRECISION_POLICY
from ._random_policy import POLICY as RANDOM_POLICY
from ._repeated_blocks import policy as blocks_policy
from ._variant_plan import Hints, Sizes, VariantRequest


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))


def _tensor_digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous()
    raw = ctypes.string_at(data.data_ptr(), data.numel() * data.element_size())
    meta = f"{data.dtype}:{tuple(data.shape)}:".encode()
    return hashlib.sha256(meta + raw).hexdigest()


_DEVICE_INDEX = re.compile(r"index=(\d+)|cuda:(\d+)")


def one_device_index(gm: torch.fx.GraphModule, graph: GraphDescription) -> int | None:
    """The CUDA device index of a graph whose every tensor input is on that one device and
    whose code names no other (its key then leaves the index out: one compile serves every
    device of its GPU model, moved with ``CompiledArtifact.to``), else None."""
    devices = {i.device for i in graph.inputs if i.kind != "int" and i.device is not None}
    if len(devices) != 1:
        return None
    (device,) = devices
    if device.type != "cuda" or device.index is None:
        return None
    named = {int(a or b) for a, b in _DEVICE_INDEX.findall(_all_code(gm))}
    return device.index if named <= {device.index} else None


def _all_code(gm: torch.fx.GraphModule) -> str:
    parts = [gm.code]
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and module is not gm:
            parts.append(module.code)
    return "\n".join(parts)


def _index_free(code: str, index: int | None) -> str:
    if index is None:
        return code
    return code.replace(f"device(type='cuda', index={index})", "device(type='cuda')").replace(
        f"cuda:{index}", "cuda"
    )


def graph_digest(gm: torch.fx.GraphModule, index: int | None = None) -> str:
    """sha256 over the graph's code, its submodules and the bytes of embedded constants
    (``index``: the one CUDA device index the code names, left out)."""
    digest = hashlib.sha256(_index_free(gm.code, index).encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.fx.GraphModule):  # a subgraph: its own code counts
                text = graph_digest(value, index)
            elif isinstance(value, torch.Tensor):
                text = _tensor_digest(value)
            else:
                text = repr(value)
            digest.update(f"\0{node.target}={text}".encode())
        elif node.op == "call_module":
            digest.update(f"\0{node.target}:{gm.get_submodule(str(node.target))!r}".encode())
    return digest.hexdigest()


def _inputs_text(graph: GraphDescription, index: int | None) -> str:
    rows: list[list[Any]] = []
    for item in graph.inputs:
        if item.kind == "int":
            rows.append(["int", str(item.value)])
        else:
            rows.append(
                [
                    "tensor",
                    str(item.dtype),
                    _index_free(str(item.device), index),
                    bool(item.requires_grad),
                    [str(s) for s in item.shape],
                    [str(s) for s in item.stride],
                    str(item.storage_offset),
                    # the value a float input's variants are specialized to, bit-exact
                    None if item.scalar is None else float(item.scalar).hex(),
                ]
            )
    ranges = {str(s): list(graph.ranges[s]) for s in graph.symbols}
    return _canonical({"inputs": rows, "ranges": ranges})


def cache_factors(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    requests: Sequence[VariantRequest],
    options: Mapping[str, Any],
    dynamic_shapes: str,
    device: str,
    index: int | None = None,
) -> dict[str, str]:
    """``index``: the graph's one CUDA device index (``one_device_index``), left out of
    every factor so that the key is the same on every device of this GPU model."""
    environment = current_environment(device)
    backward = {"backward": BACKWARD_POLICY} if has_backward(graph) else {}
    return {
        **backward,
        "graph": graph_digest(gm, index),
        "inputs": hashlib.sha256(_inputs_text(graph, index).encode()).hexdigest(),
        "variants": _canonical([[r.kind, list(r.point)] for r in requests]),
        "options": _canonical(dict(options)),
        "codegen_config": codegen_config_digest(),
        "gemm_policy": GEMM_POLICY,
        "repeated_blocks": blocks_policy(),
        "random_ops": RANDOM_POLICY,
        "precision_casts": PRECISION_POLICY,
        "dynamic_shapes": dynamic_shapes,
        # what Dynamo's global-state guard holds: grad mode (a backward graph or not),
        # autocast per device and dtype, default dtype, deterministic algorithms, matmul
        # precision, torch-function state; inside a backend, the traced call's
        "global_state": _canonical(describe_state(trace_state())),
        "torch": f"{environment.torch} ({environment.torch_git})",
        "triton": str(environment.triton),
        "python": environment.python,
        "device": f"{environment.device_type}:{environment.device_name}:{environment.capability}",
        "platform": environment.platform,
        "format": f"artifact {FORMAT_VERSION}, cache {LAYOUT}, precompile {__version__}, {KERNELS}",
    }


def cache_key(factors: Mapping[str, str]) -> str:
    return hashlib.sha256(_canonical(dict(factors)).encode()).hexdigest()


def _keyed(value: Any) -> Any:
    """A hints/sizes mapping as JSON can hold it (tuple keys as their repr)."""
    if isinstance(value, Mapping):
        return sorted([repr(k), v] for k, v in value.items())
    return value


def _describe_cache_leaf(cache: Any, dynamic_batch: bool) -> list[Any]:
    rows: list[Any] = [describe_cache(cache, "cache").to_json()]
    kind = kv_cache_kind(cache)
    for _, field, tensor in kind.tensors(cache):
        shape = [int(s) for s in tensor.shape]
        if dynamic_batch and field in kind.rows:
            shape[0] = -1
        rows.append([field, dtype_name(tensor.dtype), str(tensor.device), shape])
    return rows


def model_factors(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    dims: Mapping[int, set[int]],
    hints: Hints,
    sizes: Sizes,
    options: Mapping[str, Any],
) -> dict[str, str]:
    """The cache key's factors of a compiled model, all computed without tracing."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)), is_leaf=is_kv_cache)
    described: list[list[Any]] = []
    for index, leaf in enumerate(leaves):
        if is_kv_cache(leaf):
            described.append(["cache", _describe_cache_leaf(leaf, 0 in dims.get(index, ()))])
        elif isinstance(leaf, torch.Tensor):
            shape = [
                ("dyn" if d in dims.get(index, ()) else int(s)) for d, s in enumerate(leaf.shape)
            ]
            described.append(["tensor", dtype_name(leaf.dtype), str(leaf.device), shape,
                              bool(leaf.requires_grad)])  # fmt: skip
        else:
            described.append(["value", repr(leaf)])
    device = next((str(t.device.type) for t in leaves if isinstance(t, torch.Tensor)), "cpu")
    environment = current_environment("cuda" if device == "cuda" else "cpu")
    distributed = this_rank()
    # Under torch.distributed the key is per rank: computed without tracing, it cannot see
    # whether the trace will bake the rank in (``dist.get_rank()`` in a forward is traced
    # as a constant). Ranks whose graphs are identical still share one compiled artifact:
    # it is cached under its graph's own key, which has no rank (see _trace_and_compile).
    # Nor can it see which groups the trace will name ("1" is whichever group this process
    # made first after the default one): the key has every group registered here, so a
    # process that made its groups in another order or of other members misses.
    rank = {}
    if distributed is not None:
        groups = [[g.name, g.size, g.backend, list(g.ranks)] for g in registered_groups()]
        rank = {"distributed": _digest([*distributed, groups])}
    # a compile with grad on may have a backward graph, traced by another policy since
    backward = {"backward": BACKWARD_POLICY} if torch.is_grad_enabled() else {}
    return {
        **rank,
        **backward,
        **model_identity(model),  # model_class, model_sources, model_settings, model_tensors
        "model_mode": "train" if model.training else "eval",
        "call": _digest([str(spec), described]),
        "variants": _digest([_keyed(hints), [_keyed(s) for s in sizes or ()]]),
        "options": _digest(dict(options)),
        # inductor's config and the attention backends change the compiled code too
        "codegen_config": codegen_config_digest(),
        "gemm_policy": GEMM_POLICY,
        "repeated_blocks": blocks_policy(),
        "random_ops": RANDOM_POLICY,
        "precision_casts": PRECISION_POLICY,
        # grad mode, autocast, default dtype, ...: what Dynamo's global-state guard holds
        # (as JSON, so a miss can name the field that differs)
        "global_state": _canonical(describe_state(trace_state())),
        "torch": f"{environment.torch} ({environment.torch_git})",
        "triton": str(environment.triton),
        "python": environment.python,
        "device": f"{environment.device_type}:{environment.device_name}:{environment.capability}",
        "format": (
            # plan 2: a tensor filling two argument slots is traced as two inputs (a plan
            # 1 entry traced from labels=input_ids read the labels alone)
            f"model plan 2 (caches, distinct arguments), artifact {FORMAT_VERSION}, "
            f"precompile {__version__}, {KERNELS}"
        ),
    }
