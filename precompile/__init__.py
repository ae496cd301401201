"""precompile: compile PyTorch graphs ahead of time into multi-variant, checked artifacts.

art = precompile.standalone_compile(gm, example_inputs, hints=[16, 256, 4096])
art.save(path="model.pt2c")
art = precompile.CompiledArtifact.load(path="model.pt2c")
out = art(*flat_inputs)
"""

from runtime import (
    Candidate,
    CompiledArtifact,
    CorruptArtifactError,
    Explanation,
    IncompatibleArtifactError,
    InputMismatchError,
    InvalidOptionError,
    NoVariantError,
    PrecompileError,
    Symbol,
    SymbolSource,
    UnsupportedGraphError,
    Variant,
)

from ._standalone import standalone_compile
from ._variant_plan import DEFAULT_MAX_VARIANTS

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_VARIANTS",
    "Candidate",
    "CompiledArtifact",
    "CorruptArtifactError",
    "Explanation",
    "IncompatibleArtifactError",
    "InputMismatchError",
    "InvalidOptionError",
    "NoVariantError",
    "PrecompileError",
    "Symbol",
    "SymbolSource",
    "UnsupportedGraphError",
    "Variant",
    "standalone_compile",
]
