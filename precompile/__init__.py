"""precompile: compile PyTorch graphs ahead of time into multi-variant, checked artifacts.

art = precompile.standalone_compile(gm, example_inputs, hints=[16, 256, 4096])
art.save(path="model.pt2c")
art = precompile.CompiledArtifact.load(path="model.pt2c")
out = art(*flat_inputs)

One import name: ``precompile`` compiles, ``precompile.runtime`` is all a serving
process needs, ``precompile.cache`` stores bytes (each imports only the layers below it).
Importing this package imports none of them: every name below is imported on first use
(the compile side, Dynamo and inductor, with ``standalone_compile`` or ``backend``), so
``import precompile.cache`` costs the cache alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from precompile.cache import (
        ArtifactCache,
        CacheEntry,
        CacheScan,
        CacheStats,
        MissExplanation,
        PrunePlan,
        RemoteStore,
        VerifyReport,
        default_cache,
    )
    from precompile.runtime import (
        ArtifactAccessError,
        ArtifactNotFoundError,
        CacheRootError,
        CacheWriteError,
        Calibration,
        CalibrationEntry,
        Candidate,
        CompiledArtifact,
        CompiledModel,
        CorruptArtifactError,
        CudaGraphs,
        Explanation,
        IncompatibleArtifactError,
        IndexOutOfRangeError,
        InputMismatchError,
        InvalidOptionError,
        Manifest,
        NoVariantError,
        PayloadLimitError,
        PrecompileError,
        Symbol,
        SymbolSource,
        UnsafeCacheError,
        UnsupportedGraphError,
        UntrustedArtifactError,
        Variant,
        __version__,
        release_cuda_graphs,
    )

    from ._backend import backend
    from ._capture import capture_graph
    from ._generate import GenerateServer, PreparedShapes, serve_generate
    from ._model import compile_model, load_model
    from ._standalone import standalone_compile
    from ._variant_plan import DEFAULT_MAX_VARIANTS

_CACHE = ("ArtifactCache", "CacheEntry", "CacheScan", "CacheStats", "MissExplanation",
          "PrunePlan", "RemoteStore", "VerifyReport", "default_cache")  # fmt: skip
_RUNTIME = ("ArtifactAccessError", "ArtifactNotFoundError", "CacheRootError", "CacheWriteError",
            "Calibration", "CalibrationEntry", "Candidate", "CompiledArtifact", "CompiledModel",
            "CorruptArtifactError", "CudaGraphs", "Explanation", "IncompatibleArtifactError",
            "IndexOutOfRangeError", "InputMismatchError", "InvalidOptionError", "Manifest",
            "NoVariantError", "PayloadLimitError", "PrecompileError", "Symbol", "SymbolSource",
            "UnsafeCacheError", "UnsupportedGraphError", "UntrustedArtifactError", "Variant",
            "__version__", "release_cuda_graphs")  # fmt: skip
# name -> the module it is imported from on first use
_LAZY = {
    **dict.fromkeys(_CACHE, "precompile.cache"),
    **dict.fromkeys(_RUNTIME, "precompile.runtime"),
    "compile_model": "precompile._model",
    "load_model": "precompile._model",
    "backend": "precompile._backend",
    "capture_graph": "precompile._capture",
    "GenerateServer": "precompile._generate",
    "PreparedShapes": "precompile._generate",
    "serve_generate": "precompile._generate",
    "standalone_compile": "precompile._standalone",
    "DEFAULT_MAX_VARIANTS": "precompile._variant_plan",
}


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name's module on its first use, then keep the value."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'precompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "DEFAULT_MAX_VARIANTS",
    "ArtifactAccessError",
    "ArtifactCache",
    "ArtifactNotFoundError",
    "CacheEntry",
    "CacheScan",
    "CacheStats",
    "CacheRootError",
    "CacheWriteError",
    "Calibration",
    "CalibrationEntry",
    "Candidate",
    "CompiledArtifact",
    "CompiledModel",
    "CorruptArtifactError",
    "PayloadLimitError",
    "CudaGraphs",
    "Explanation",
    "GenerateServer",
    "IncompatibleArtifactError",
    "IndexOutOfRangeError",
    "InputMismatchError",
    "InvalidOptionError",
    "Manifest",
    "MissExplanation",
    "NoVariantError",
    "PrecompileError",
    "PreparedShapes",
    "PrunePlan",
    "RemoteStore",
    "Symbol",
    "SymbolSource",
    "UnsafeCacheError",
    "UnsupportedGraphError",
    "UntrustedArtifactError",
    "Variant",
    "VerifyReport",
    "__version__",
    "backend",
    "capture_graph",
    "compile_model",
    "default_cache",
    "load_model",
    "release_cuda_graphs",
    "serve_generate",
    "standalone_compile",
]
