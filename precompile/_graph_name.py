"""What a person calls a graph (``Model.forward (file.py:30)``): the name ``cache ls``
shows an entry under."""

from __future__ import annotations

import os

import torch

from . import _torch_adapter as adapter

_GRAPH_NAME = "precompile_graph_name"  # in a GraphModule's ``meta``


def name_graph(gm: torch.fx.GraphModule, name: str | None = None) -> None:
    """Keep ``name`` (else ``graph_name(gm)``) on the graph (called inside a backend, by
    ``capture_graph``)."""
    gm.meta[_GRAPH_NAME] = name or graph_name(gm)


def graph_name(gm: torch.fx.GraphModule) -> str:
    """What a person calls the graph: inside a torch.compile backend (or as kept by
    ``name_graph``), the function Dynamo traced it from (``Model.forward (file.py:30)``);
    else its GraphModule's class (``fx.symbolic_trace`` names it after the module's)."""
    kept = gm.meta.get(_GRAPH_NAME)
    if isinstance(kept, str):
        return kept
    codes = adapter.traced_codes()
    if not codes:
        return type(gm).__name__
    # The frame Dynamo compiles comes first, the functions it inlined follow. Torch's own
    # wrappers (``capture_graph`` traces through ``wrap_inline``) say nothing of the
    # model: the first code outside torch names it, else torch's first ``forward`` (an
    # ``nn.Sequential``'s), else the first code outside Dynamo.
    torch_dir, dynamo_dir = adapter.torch_code_dirs()
    code = min(codes, key=lambda c: (c.co_filename.startswith(torch_dir),
                                     c.co_filename.startswith(dynamo_dir),
                                     c.co_name != "forward"))  # fmt: skip
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
