"""Load precompiled artifacts and dispatch calls to their variants, never compiling."""

from ._artifact import ArtifactFormat, CompiledArtifact
from ._dispatch import Candidate, Explanation, log2_distance
from ._errors import (
    CorruptArtifactError,
    IncompatibleArtifactError,
    InputMismatchError,
    InvalidOptionError,
    NoVariantError,
    PrecompileError,
    UnsafeCacheError,
    UnsupportedGraphError,
)
from ._manifest import Environment, Manifest, Symbol, SymbolSource, Variant

__all__ = [
    "ArtifactFormat",
    "Candidate",
    "CompiledArtifact",
    "CorruptArtifactError",
    "Environment",
    "Explanation",
    "IncompatibleArtifactError",
    "InputMismatchError",
    "InvalidOptionError",
    "Manifest",
    "NoVariantError",
    "PrecompileError",
    "Symbol",
    "SymbolSource",
    "UnsafeCacheError",
    "UnsupportedGraphError",
    "Variant",
    "log2_distance",
]
