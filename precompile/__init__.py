"""precompile: compile PyTorch graphs ahead of time into multi-variant, checked artifacts.

art = precompile.standalone_compile(gm, example_inputs, hints=[16, 256, 4096])
art.save(path="model.pt2c")
art = precompile.CompiledArtifact.load(path="model.pt2c")
out = art(*flat_inputs)
"""

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
    CacheWriteError,
    Calibration,
    CalibrationEntry,
    Candidate,
    CompiledArtifact,
    CorruptArtifactError,
    Explanation,
    IncompatibleArtifactError,
    InputMismatchError,
    InvalidOptionError,
    Manifest,
    NoVariantError,
    PrecompileError,
    Symbol,
    SymbolSource,
    UnsafeCacheError,
    UnsupportedGraphError,
    UntrustedArtifactError,
    Variant,
)

from ._backend import backend
from ._standalone import standalone_compile
from ._variant_plan import DEFAULT_MAX_VARIANTS

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_VARIANTS",
    "ArtifactAccessError",
    "ArtifactCache",
    "ArtifactNotFoundError",
    "CacheEntry",
    "CacheScan",
    "CacheStats",
    "CacheWriteError",
    "Calibration",
    "CalibrationEntry",
    "Candidate",
    "CompiledArtifact",
    "CorruptArtifactError",
    "Explanation",
    "IncompatibleArtifactError",
    "InputMismatchError",
    "InvalidOptionError",
    "Manifest",
    "MissExplanation",
    "NoVariantError",
    "PrecompileError",
    "PrunePlan",
    "Symbol",
    "SymbolSource",
    "UnsupportedGraphError",
    "UnsafeCacheError",
    "UntrustedArtifactError",
    "Variant",
    "VerifyReport",
    "backend",
    "default_cache",
    "standalone_compile",
]
