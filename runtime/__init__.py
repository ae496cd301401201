"""Load precompiled artifacts and dispatch calls to their variants, never compiling.

Importing this package is cheap (errors, the manifest schema): a serving process pays
for torch's compiler modules when it first touches ``CompiledArtifact`` (whose module
imports what loading and running a variant needs, so that ``load()`` and the first call
have short, predictable latency). The cache CLI never pays it.
"""

from __future__ import annotations

# The folder runtime/ is the package precompile.runtime. A checkout's root on sys.path makes it
# importable as "runtime" too: a second copy of every module, whose patches and state the
# real one never sees. Refused, by name.
if __name__ != "precompile.runtime":
    raise ImportError(
        f"import precompile.runtime, not {__name__}: runtime/ is that package's folder"
    )

from typing import TYPE_CHECKING

from ._errors import (
    ArtifactAccessError,
    ArtifactNotFoundError,
    CacheRootError,
    CacheWriteError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    IndexOutOfRangeError,
    InputMismatchError,
    InvalidOptionError,
    NoVariantError,
    PayloadLimitError,
    PrecompileError,
    UnsafeCacheError,
    UnsupportedGraphError,
    UntrustedArtifactError,
)
from ._lazy import lazy_getattr
from ._manifest import (
    Calibration,
    CalibrationEntry,
    Environment,
    LeanCall,
    Manifest,
    NativeKernel,
    Symbol,
    SymbolSource,
    Variant,
)
from ._version import __version__

if TYPE_CHECKING:
    from ._artifact import ArtifactFormat, CompiledArtifact
    from ._cudagraphs import CudaGraphs
    from ._dispatch import Candidate, Explanation, log2_distance
    from ._graph_release import release_cuda_graphs
    from ._model import CompiledModel, load_model

_LAZY = {
    "CompiledModel": "._model",
    "load_model": "._model",
    "CudaGraphs": "._cudagraphs",
    "ArtifactFormat": "._artifact",
    "CompiledArtifact": "._artifact",
    "Candidate": "._dispatch",
    "Explanation": "._dispatch",
    "log2_distance": "._dispatch",
    "release_cuda_graphs": "._graph_release",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

__all__ = [
    "ArtifactAccessError",
    "ArtifactFormat",
    "ArtifactNotFoundError",
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
    "Environment",
    "Explanation",
    "IncompatibleArtifactError",
    "IndexOutOfRangeError",
    "InputMismatchError",
    "InvalidOptionError",
    "LeanCall",
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
    "__version__",
    "load_model",
    "log2_distance",
    "release_cuda_graphs",
]
