"""``capture_graph``: the FX graph and example inputs Dynamo hands a backend, for
compiling outside ``torch.compile`` (the demo, benchmarks, tests and users who want the
artifact itself rather than a compiled model)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import _torch_adapter as adapter
from ._graph_name import name_graph


def capture_graph(
    model: Any,
    *args: Any,
    dynamic: Mapping[int, Sequence[int]] | bool | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Trace ``model(*args, **kwargs)`` with Dynamo (one full graph) and return the graph
    and example inputs its backend receives. ``dynamic``: ``{arg_position: [dims]}`` to
    mark dynamic (``mark_dynamic``), ``True`` for ``torch.compile(dynamic=True)``, None
    for Dynamo's default. Traced under ``torch.no_grad()``."""
    box: dict[str, Any] = {}

    def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # what it was traced from, for when it is compiled later (``cache ls``)
        name_graph(gm, _traced_name(model))
        box["gm"], box["inputs"] = gm, list(example_inputs)
        return gm.forward

    # the marks are this trace's: the caller's tensors get back the ones they had
    marked = [args[p] for p in dynamic] if isinstance(dynamic, Mapping) else []
    with adapter.marks_put_back(marked):
        if isinstance(dynamic, Mapping):
            for position, dims in dynamic.items():
                for dim in dims:
                    adapter.mark_dynamic(args[position], dim)
        torch.compiler.reset()
        with torch.no_grad():
            torch.compile(model, backend=keep, fullgraph=True, dynamic=dynamic is True or None)(
                *args, **dict(kwargs or {})
            )
    return box["gm"], box["inputs"]


def _traced_name(model: Any) -> str | None:
    """``Model.forward (file.py:30)``: the model's own name, where Dynamo's first traced
    frame is torch's wrapper around it."""
    module = isinstance(model, torch.nn.Module)
    function = type(model).forward if module else model
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return None
    name = (
        f"{type(model).__qualname__}.forward"
        if module
        else getattr(function, "__qualname__", code.co_name)
    )
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
