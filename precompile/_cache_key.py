"""The cache key: everything that changes the compiled code, and nothing else.

Each factor is kept by name in the cache entry, so a miss can say which factor
differs from the nearest existing entry. Paths, pids and timestamps never enter it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from precompile.cache import LAYOUT
from precompile.runtime._environment import current_environment
from precompile.runtime._global_state import describe as describe_state
from precompile.runtime._global_state import trace_state
from precompile.runtime._manifest import FORMAT_VERSION
from precompile.runtime._version import __version__

from . import _torch_adapter as adapter
from ._gemm_policy import POLICY as GEMM_POLICY
from ._graph import GraphDescription
from ._variant_plan import VariantRequest


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))


def _tensor_digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous()
    raw = ctypes.string_at(data.data_ptr(), data.numel() * data.element_size())
    meta = f"{data.dtype}:{tuple(data.shape)}:".encode()
    return hashlib.sha256(meta + raw).hexdigest()


def graph_digest(gm: torch.fx.GraphModule) -> str:
    """sha256 over the graph's code, its submodules and the bytes of embedded constants."""
    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            text = _tensor_digest(value) if isinstance(value, torch.Tensor) else repr(value)
            digest.update(f"\0{node.target}={text}".encode())
        elif node.op == "call_module":
            digest.update(f"\0{node.target}:{gm.get_submodule(str(node.target))!r}".encode())
    return digest.hexdigest()


def _inputs_text(graph: GraphDescription) -> str:
    rows: list[list[Any]] = []
    for item in graph.inputs:
        if item.kind == "int":
            rows.append(["int", str(item.value)])
        else:
            rows.append(
                [
                    "tensor",
                    str(item.dtype),
                    str(item.device),
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
) -> dict[str, str]:
    environment = current_environment(device)
    return {
        "graph": graph_digest(gm),
        "inputs": hashlib.sha256(_inputs_text(graph).encode()).hexdigest(),
        "variants": _canonical([[r.kind, list(r.point)] for r in requests]),
        "options": _canonical(dict(options)),
        "codegen_config": adapter.codegen_config_digest(),
        "gemm_policy": GEMM_POLICY,
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
        "format": f"artifact {FORMAT_VERSION}, cache {LAYOUT}, precompile {__version__}",
    }


def cache_key(factors: Mapping[str, str]) -> str:
    return hashlib.sha256(_canonical(dict(factors)).encode()).hexdigest()
