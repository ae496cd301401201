"""The process-wide default cache (``$PRECOMPILE_CACHE_DIR`` or the user cache dir)."""

from __future__ import annotations

import threading

from ._root import resolve_root
from ._store import ArtifactCache

_lock = threading.Lock()
_default: ArtifactCache | None = None


def default_cache() -> ArtifactCache:
    """The cache ``standalone_compile`` and ``CompiledArtifact.load(tag=...)`` use when
    none is given; made again if ``$PRECOMPILE_CACHE_DIR`` changed."""
    global _default
    root = resolve_root(None)
    with _lock:
        if _default is None or _default.root != root:
            _default = ArtifactCache(root)
        return _default
