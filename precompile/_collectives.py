"""A graph's collectives: the process groups they run over (what an artifact's manifest
names), and a mode that runs them as local copies for the one traced run of
``compile_model``, whose values nobody reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from precompile.runtime import UnsupportedGraphError

from . import _torch_adapter as adapter

# torch's collectives whose ``group_name`` argument is a name torch registered a process
# group under (resolved again by the op at every call)
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
_TORCH_COLLECTIVE_NAMESPACES = (*_FUNCTIONAL_NAMESPACES, "symm_mem", "_dtensor")


@dataclass(frozen=True)
class GraphCollectives:
    """What a graph's collectives run over. ``groups``: the names of the torch process
    groups torch's own collectives name. ``opaque``: other ops taking a ``group_name`` (a
    framework's own collectives: vLLM's ``vllm::all_reduce(x, group_name="tp:0")`` names
    its own registry, not torch's), whose group this library cannot see."""

    groups: tuple[str, ...]
    opaque: tuple[str, ...]


def graph_collectives(gm: torch.fx.GraphModule) -> GraphCollectives:
    """The graph's collectives, in first-use order."""
    groups: dict[str, None] = {}
    opaque: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        signature = adapter.op_signature(node.target)
        if signature is None:
            continue
        qualified, arguments = signature
        namespace = qualified.split("::", 1)[0]
        names = list(arguments)
        if "group_name" not in names:
            if namespace == "c10d_functional":
                raise UnsupportedGraphError(
                    f"the graph calls {qualified}, a legacy collective that names its group "
                    "by tag and ranks; use torch.distributed._functional_collectives"
                )
            continue
        if namespace not in _TORCH_COLLECTIVE_NAMESPACES:
            opaque.setdefault(qualified)
            continue
        position = names.index("group_name")
        value = node.args[position] if position < len(node.args) else node.kwargs.get("group_name")
        if not isinstance(value, str):
            raise UnsupportedGraphError(
                f"the graph calls {qualified} with group {value!r}; precompile needs the "
                "group named by a string (what torch.distributed._functional_collectives "
                "traces to)"
            )
        groups.setdefault(value)
    return GraphCollectives(tuple(groups), tuple(opaque))


def _writes_nothing(func: Any, args: Any, kwargs: Any) -> Any:
    """What a collective returns, run here alone: outputs of the shapes, strides and
    dtypes its fake implementation gives, filled with zeros; nothing is written."""
    fake = adapter.fake_run(func, args, kwargs)

    def real(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        empty = torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=value.device
        )
        return empty.zero_()

    return real(fake) if adapter.op_return_count(func) == 1 else tuple(real(v) for v in fake)


class LocalCollectives(adapter.DispatchMode):  # type: ignore[misc]
    """Collectives as local no-ops of the same shapes, for one run whose values nobody
    reads (compile_model's trace: it learns the output structure and what the call
    writes). A real collective there would wait for ranks that are not tracing."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        qualified, arguments = adapter.overload_signature(func)
        takes_group = "group_name" in arguments
        namespace = adapter.op_namespace(func)
        if namespace not in _TORCH_COLLECTIVE_NAMESPACES and not takes_group:
            return func(*args, **kwargs)
        name = qualified.split("::", 1)[1]
        if namespace in _FUNCTIONAL_NAMESPACES:  # local copies known per op
            if name in ("wait_tensor", "all_reduce_", "all_reduce_coalesced_", "broadcast_"):
                return args[0]
            if name in ("all_reduce", "broadcast"):
                return args[0].clone()
            if name == "all_reduce_coalesced":
                return [t.clone() for t in args[0]]
            if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
                gathered = torch.cat([args[0]] * int(args[1]))
                out = kwargs.get("out")
                return gathered if out is None else out.copy_(gathered)
            if name == "reduce_scatter_tensor":
                return args[0].narrow(0, 0, args[0].shape[0] // int(args[2])).clone()
        if not takes_group:
            raise UnsupportedGraphError(
                f"compile_model cannot trace a graph that calls {func}: its one traced run "
                "replaces collectives by local copies, and knows none for this one"
            )
        try:
            return _writes_nothing(func, args, kwargs)
        except Exception as exc:  # no fake implementation, or one that fails
            raise UnsupportedGraphError(
                f"compile_model cannot trace a graph that calls {func}: its one traced run "
                "makes collectives local (a real one would wait for ranks that are not "
                f"tracing), from the op's fake implementation, which failed: {exc}"
            ) from exc
