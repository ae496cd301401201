"""``precompile.backend``: a torch.compile backend that compiles variants once, ever.

A second process running the same model finds every graph in the cache: Dynamo still
traces, but no inductor compile runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from precompile.cache import CacheOption, CacheRootError
from precompile.runtime import ArtifactNotFoundError, CompiledArtifact
from precompile.runtime.compiler_interface import CudaGraphsOption

from ._offline import is_offline
from ._standalone import CalibrateOption, check_policy_switches, standalone_compile
from ._variant_plan import DEFAULT_MAX_VARIANTS, Hints, Sizes

log = logging.getLogger("precompile.compile")


def backend(
    *,
    hints: Hints = None,
    sizes: Sizes = None,
    options: Mapping[str, Any] | None = None,
    cache: CacheOption = None,
    max_variants: int = DEFAULT_MAX_VARIANTS,
    calibrate: CalibrateOption = None,
    cudagraphs: CudaGraphsOption = None,
    compile: bool = True,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """``torch.compile(model, backend=precompile.backend(hints=[16, 256, 4096]))``.

    Graphs without dynamic dims (Dynamo's static compile at size 1, say) ignore ``hints``,
    ``sizes`` and ``calibrate`` and compile to one variant; dynamic graphs get the
    requested variants. Dynamo calls what this returns only with inputs its guards
    accepted, so the per-call check is Dynamo's: the artifact reads the sizes and
    dispatches (``CompiledArtifact.trusting_caller``), at a cost that does not grow with
    the number of inputs (a model's parameters among them). ``cudagraphs``: replay a
    CUDA graph per size (see ``CudaGraphs``), captured from the artifact, never compiled.
    ``compile=False`` (or ``PRECOMPILE_OFFLINE=1``): a graph not in the cache raises
    ``ArtifactNotFoundError`` instead of compiling (a server that must never compile).
    """
    check_policy_switches(options)  # a bad options is named here, not at the first call

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def compiled(store: CacheOption) -> CompiledArtifact:
            return standalone_compile(
                gm,
                example_inputs,
                dynamic_shapes="from_tracing_context",
                options=options,
                hints=hints,
                sizes=sizes,
                max_variants=max_variants,
                cache=store,
                calibrate=calibrate,
                cudagraphs=cudagraphs,
                compile=compile,
            )

        static = hints is not None and _static_graph(example_inputs)
        if static:
            _warn_static_once()
        try:
            artifact = compiled(cache)
        except ArtifactNotFoundError as exc:
            if static:
                raise ArtifactNotFoundError(f"{exc}. {ORDER_HINT}", key=exc.key) from None
            raise
        except CacheRootError as exc:
            if is_offline(compile):
                raise  # nothing may compile, and nothing can be found: say why
            # Inside torch.compile a bad cache setting costs the cache, not the model
            # (as a read-only disk does): compile, uncached, and say which setting.
            setting = (
                f"PRECOMPILE_CACHE_DIR={os.environ.get('PRECOMPILE_CACHE_DIR')!r}"
                if cache is None or cache is True
                else f"precompile.backend(cache={cache!r})"
            )  # fmt: skip
            log.warning("%s (set by %s); compiling without a cache", exc, setting)
            artifact = compiled(False)
        return artifact.trusting_caller()

    return compile_graph


# Dynamo's first trace of a frame is static (automatic dynamic marks a dim dynamic only
# once a second size is seen): which sizes that graph holds depends on the first call.
ORDER_HINT = (
    "Dynamo handed this backend a static graph (its first trace of the frame, at the first "
    "call's sizes): a build and a server whose first calls have other sizes trace other "
    "graphs. Pass dynamic=True to torch.compile (or torch._dynamo.mark_dynamic the "
    "inputs' varying dims) so that the graphs do not depend on the order of requests"
)
_warned_static = False


def _static_graph(example_inputs: list[Any]) -> bool:
    """Whether Dynamo traced this graph with every size fixed."""
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return False
        if isinstance(value, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())
        ):
            return False
    return True


def _warn_static_once() -> None:
    global _warned_static
    if not _warned_static:
        _warned_static = True
        log.warning("precompile.backend was given hints, but: %s", ORDER_HINT)
