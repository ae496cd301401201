"""``trace_model``: one Dynamo trace of a whole model's call (``compile_model``), its one
graph compiled inside the backend and run once, with every guard Dynamo kept."""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from precompile.runtime import PrecompileError, UnsupportedGraphError

from . import _torch_adapter as adapter
from ._collectives import LocalCollectives
from ._operator_kernels import operator_kernel_code


@dataclass
class ModelTrace:
    """One Dynamo trace of ``model(*args, **kwargs)`` with its one graph compiled."""

    call: tuple[tuple[Any, ...], dict[str, Any]]
    result: Any  # what the traced call returned
    example_inputs: list[Any]  # what Dynamo handed the backend (real tensors, SymInts)
    placeholder_names: list[str]
    graph_outputs: list[Any]  # the flat outputs the compiled graph returned
    traced_files: set[str]  # source files of every code object Dynamo traced
    artifact: Any
    # Dynamo's guards of the trace, as plain records (see ``adapter.guard_entry``)
    guards: list[adapter.GuardEntry] = field(default_factory=list)
    traced_code: Any = None  # the code object of the frame Dynamo compiled
    # Dynamo's own function around the model, where it traced that as the top frame in
    # place of the forward (torch.nn's own modules: ``adapter.top_frame_wrapper``)
    wrapper: Any = None
    # graph outputs that are sizes (SymInt, SymFloat, SymBool: ``x.shape[0]``), by name
    size_outputs: tuple[str, ...] = ()
    # code it traced or its custom ops ran that has no source file (``python -c``, a
    # notebook cell): checked at load by name where it can be found (``_model_plan``)
    fileless_code: set[types.CodeType] = field(default_factory=set)
    # the same for code its custom ops' kernels ran (the caller's alone): where no name
    # finds it, the plan cannot be checked and no later process uses it
    kernel_fileless_code: set[types.CodeType] = field(default_factory=set)


def trace_model(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compile_graph: Any,
    before_run: Callable[[Any, Any, Sequence[Any]], None] | None = None,
) -> ModelTrace:
    """Trace the call once with Dynamo (``fullgraph``: a graph break is an
    ``UnsupportedGraphError`` quoting Dynamo's explanation), compile its graph with
    ``compile_graph(gm, example_inputs)`` inside the backend, and run it once (with its
    collectives, if any, made local: ranks trace at different times, or not at all).
    ``before_run(gm, artifact, flat_inputs)`` is called just before that run: the
    compiled artifact's manifest says which of those inputs the graph writes."""
    seen: list[dict[str, Any]] = []
    guards: list[adapter.GuardEntry] = []

    def keep_every_guard(entries: Sequence[Any]) -> list[bool]:
        guards.extend(adapter.guard_entry(e) for e in entries)
        return [True] * len(entries)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        codes = adapter.traced_codes()
        kernel_files, kernel_code = operator_kernel_code(gm)  # custom ops traced through
        record: dict[str, Any] = {
            "code": codes[0] if codes else None,
            "inputs": list(example_inputs),
            "names": [n.name for n in gm.graph.nodes if n.op == "placeholder"],
            "files": {c.co_filename for c in codes if os.path.isfile(c.co_filename)} | kernel_files,
            "fileless": {c for c in codes if not os.path.isfile(c.co_filename)},
            "kernel_fileless": kernel_code,
            "artifact": compile_graph(gm, list(example_inputs)),
            "outputs": None,
            "size_outputs": tuple(_size_outputs(gm)),
        }
        seen.append(record)

        collectives = bool(record["artifact"].manifest.process_groups)

        def run(*flat: Any) -> Any:
            if before_run is not None:
                before_run(gm, record["artifact"], flat)
            with LocalCollectives() if collectives else contextlib.nullcontext():
                outputs = record["artifact"](*flat)
            record["outputs"] = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            return outputs

        return run

    torch.compiler.reset()
    try:
        compiled = torch.compile(
            model, backend=backend, fullgraph=True, options={"guard_filter_fn": keep_every_guard}
        )
        wrapper = adapter.top_frame_wrapper(compiled)
        result = compiled(*args, **kwargs)
    except adapter.graph_break_error() as exc:
        raise UnsupportedGraphError(
            f"the model does not trace as one graph (a graph break): {str(exc).strip()[:2000]}"
        ) from None
    except adapter.trace_user_error() as exc:  # a custom op's kernel reading a value, say
        raise UnsupportedGraphError(
            f"the model does not trace: its code needs what a trace cannot know "
            f"({type(exc).__name__}): {str(exc).strip()[:2000]}"
        ) from None
    except Exception as exc:
        # Dynamo wraps what the backend raised: one of ours (a refusal naming the input)
        # is raised as itself, so callers catch it by its class
        inner = adapter.backend_failure(exc)
        if isinstance(inner, PrecompileError):
            raise inner from None
        raise
    finally:
        torch.compiler.reset()
    if len(seen) != 1:
        raise UnsupportedGraphError(f"tracing the model gave {len(seen)} graphs; it needs one")
    record = seen[0]
    if record["outputs"] is None:
        raise UnsupportedGraphError("the traced graph never ran; its outputs are unknown")
    return ModelTrace(
        call=(args, kwargs),
        result=result,
        example_inputs=record["inputs"],
        placeholder_names=record["names"],
        graph_outputs=record["outputs"],
        traced_files=record["files"],
        artifact=record["artifact"],
        guards=guards,
        traced_code=record["code"],
        wrapper=wrapper,
        size_outputs=record["size_outputs"],
        fileless_code=record["fileless"],
        kernel_fileless_code=record["kernel_fileless"],
    )


def _size_outputs(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's outputs that are symbolic sizes, not tensors: a forward that returns
    ``x.shape[0]`` of a dynamic dim (or a shape), or stores it in an attribute, makes
    Dynamo return it from the graph."""
    found: list[str] = []
    sizes = (torch.SymInt, torch.SymFloat, torch.SymBool)

    def look(node: torch.fx.Node) -> torch.fx.Node:
        if isinstance(node.meta.get("example_value"), sizes):
            found.append(node.name)
        return node

    for node in gm.graph.nodes:
        if node.op == "output":
            torch.fx.node.map_arg(node.args, look)
    return found
