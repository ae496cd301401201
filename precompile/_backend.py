"""``precompile.backend``: a torch.compile backend that compiles variants once, ever.

A second process running the same model finds every graph in the cache: Dynamo still
traces, but no inductor compile runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._standalone import CacheOption, CalibrateOption, standalone_compile
from ._variant_plan import DEFAULT_MAX_VARIANTS, Hints, Sizes


def backend(
    *,
    hints: Hints = None,
    sizes: Sizes = None,
    options: Mapping[str, Any] | None = None,
    cache: CacheOption = None,
    max_variants: int = DEFAULT_MAX_VARIANTS,
    calibrate: CalibrateOption = None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """``torch.compile(model, backend=precompile.backend(hints=[16, 256, 4096]))``.

    Graphs without dynamic dims (Dynamo's first, static compile) ignore ``hints`` and
    ``sizes`` and compile to one variant; dynamic graphs get the requested variants.
    """

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        dynamic = any(isinstance(v, torch.SymInt) for v in example_inputs) or any(
            isinstance(s, torch.SymInt)
            for node in gm.graph.nodes
            if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor)
            for s in node.meta["example_value"].shape
        )
        return standalone_compile(
            gm,
            example_inputs,
            dynamic_shapes="from_tracing_context",
            options=options,
            hints=hints if dynamic else None,
            sizes=sizes if dynamic else None,
            max_variants=max_variants,
            cache=cache,
            calibrate=calibrate if dynamic else None,
        )

    return compile_graph
