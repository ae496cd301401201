"""precompile: compile PyTorch graphs ahead of time into multi-variant, checked artifacts.

art = precompile.standalone_compile(gm, example_inputs, hints=[16, 256, 4096])
art.save(path="model.pt2c")
art = precompile.CompiledArtifact.load(path="model.pt2c")
out = art(*flat_inputs)

Importing the package is cheap: the compile side (Dynamo, inductor) is imported when
``standalone_compile`` or ``backend`` is first used, the runtime's torch modules when
``CompiledArtifact`` is; the CLI needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache import (
    ArtifactCache,
    CacheEntry,
    CacheScan,
    CacheStats,
    MissExplanation,
    PrunePlan,
    VerifyReport,
    default_cache,
)
from runtime import (
    ArtifactAccessError,
    ArtifactNotFoundError,
    CacheRootError,
    CacheWriteError,
    Calibration,
    CalibrationEntry,
    CorruptArtifactError,
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
)
from runtime._lazy import lazy_getattr

from ._variant_plan import DEFAULT_MAX_VARIANTS

if TYPE_CHECKING:
    from runtime import Candidate, CompiledArtifact, CompiledModel, CudaGraphs, Explanation

    from ._backend import backend
    from ._capture import capture_graph
    from ._generate import GenerateServer, serve_generate
    from ._model import compile_model, load_model
    from ._standalone import standalone_compile

_LAZY = {
    "CompiledModel": "runtime",
    "compile_model": "precompile._model",
    "load_model": "precompile._model",
    "CompiledArtifact": "runtime",
    "CudaGraphs": "runtime",
    "Candidate": "runtime",
    "Explanation": "runtime",
    "backend": "precompile._backend",
    "capture_graph": "precompile._capture",
    "GenerateServer": "precompile._generate",
    "serve_generate": "precompile._generate",
    "standalone_compile": "precompile._standalone",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

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
    "PrunePlan",
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
    "serve_generate",
    "standalone_compile",
]
