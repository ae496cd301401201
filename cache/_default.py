"""The process-wide default cache (``$PRECOMPILE_CACHE_DIR`` or the user cache dir)."""

from __future__ import annotations

import os
import threading

from ._errors import InvalidOptionError
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


CacheOption = ArtifactCache | str | os.PathLike[str] | bool | None


def resolve_cache(cache: CacheOption) -> ArtifactCache | None:
    """``cache=`` as the compile functions take it: None or True the default cache,
    False none, a path or an ArtifactCache that one."""
    if cache is False:
        return None
    if cache is None or cache is True:
        return default_cache()
    if isinstance(cache, ArtifactCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return ArtifactCache(cache)
    raise InvalidOptionError(
        f"cache must be None (the default cache), False, a path or an ArtifactCache, got {cache!r}"
    )


def cache_to_read(cache: CacheOption) -> ArtifactCache:
    """``cache=`` of a load by key or tag: None the default cache, a path or an
    ArtifactCache that one (False, no cache, cannot be read from)."""
    store = resolve_cache(cache)
    if store is None:
        raise InvalidOptionError(
            "loading by key or tag needs a cache: pass None, a path or an ArtifactCache"
        )
    return store
