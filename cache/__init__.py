"""Content-addressed on-disk cache of precompile artifacts, safe across processes."""

from ._entry import CacheEntry, CacheStats, MissExplanation, VerifyReport
from ._root import LAYOUT, resolve_root
from ._store import DEFAULT_SIZE_LIMIT, ArtifactCache

__all__ = [
    "DEFAULT_SIZE_LIMIT",
    "LAYOUT",
    "ArtifactCache",
    "CacheEntry",
    "CacheStats",
    "MissExplanation",
    "VerifyReport",
    "resolve_root",
]
