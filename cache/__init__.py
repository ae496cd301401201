"""Content-addressed on-disk store of precompile entries, safe across processes.

It stores documents and blobs and names them (tags); building an artifact from an entry
is the runtime's job (``CompiledArtifact.load(key=..., tag=...)``).
"""

from ._default import CacheOption, cache_to_read, default_cache, resolve_cache
from ._entry import (
    CacheEntry,
    CacheScan,
    CacheStats,
    MissExplanation,
    PrunePlan,
    RemoteScan,
    StoredEntry,
    VerifiedBlobs,
    VerifyReport,
)
from ._errors import (
    ArtifactAccessError,
    CacheRootError,
    CacheWriteError,
    CorruptArtifactError,
    InvalidOptionError,
    PayloadLimitError,
    PrecompileError,
    UnsafeCacheError,
    UntrustedArtifactError,
)
from ._get_or_build import get_or_build
from ._root import LAYOUT, resolve_root
from ._store import DEFAULT_SIZE_LIMIT, ArtifactCache

__all__ = [
    "DEFAULT_SIZE_LIMIT",
    "LAYOUT",
    "ArtifactAccessError",
    "ArtifactCache",
    "CacheEntry",
    "CacheOption",
    "CacheRootError",
    "CacheScan",
    "CacheStats",
    "CacheWriteError",
    "CorruptArtifactError",
    "PayloadLimitError",
    "InvalidOptionError",
    "MissExplanation",
    "PrecompileError",
    "PrunePlan",
    "RemoteScan",
    "StoredEntry",
    "UnsafeCacheError",
    "UntrustedArtifactError",
    "VerifiedBlobs",
    "VerifyReport",
    "cache_to_read",
    "default_cache",
    "get_or_build",
    "resolve_cache",
    "resolve_root",
]
