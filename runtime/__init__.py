"""Load precompiled artifacts and dispatch calls to their variants, never compiling."""

from ._artifact import ArtifactFormat, CompiledArtifact
from ._dispatch import Candidate, Explanation, log2_distance
from ._errors import (
    ArtifactAccessError,
    ArtifactNotFoundError,
    CacheWriteError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    InputMismatchError,
    InvalidOptionError,
    NoVariantError,
    PrecompileError,
    UnsafeCacheError,
    UnsupportedGraphError,
    UntrustedArtifactError,
)
from ._manifest import (
    Calibration,
    CalibrationEntry,
    Environment,
    Manifest,
    NativeKernel,
    Symbol,
    SymbolSource,
    Variant,
)
from ._torch_adapter import import_runtime_modules as _import_runtime_modules

_import_runtime_modules()

__all__ = [
    "ArtifactAccessError",
    "ArtifactFormat",
    "ArtifactNotFoundError",
    "CacheWriteError",
    "Calibration",
    "CalibrationEntry",
    "Candidate",
    "CompiledArtifact",
    "CorruptArtifactError",
    "Environment",
    "Explanation",
    "IncompatibleArtifactError",
    "InputMismatchError",
    "InvalidOptionError",
    "Manifest",
    "NativeKernel",
    "NoVariantError",
    "PrecompileError",
    "Symbol",
    "SymbolSource",
    "UnsafeCacheError",
    "UnsupportedGraphError",
    "UntrustedArtifactError",
    "Variant",
    "log2_distance",
]
