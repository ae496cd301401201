"""Get or build: the one protocol by which a compile goes through the cache.

Look up the key; refuse when offline; take the key's lock (single flight across
processes); look again (another process, or machine, may have built it meanwhile);
build; store; log. The cache stores bytes and knows nothing of what is built: the
caller passes how to load, build and store its object. A cache that cannot store
(read-only, full) costs the cache, never the build.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import NoReturn, TypeVar

from ._errors import CacheWriteError
from ._store import ArtifactCache

log = logging.getLogger("precompile.cache")

Built = TypeVar("Built")


def get_or_build(
    store: ArtifactCache | None,
    key: str,
    factors: Mapping[str, str],
    *,
    load: Callable[[ArtifactCache], Built | None],
    build: Callable[[ArtifactCache | None], Built],
    save: Callable[[ArtifactCache, Built], None],
    refuse: Callable[[], NoReturn] | None = None,
    what: str = "entry",
) -> Built:
    """The object under ``key``: loaded from ``store``, else built and saved.

    ``load(store)`` returns None for an entry it cannot use (absent, untrusted, stale).
    ``build(store)`` is given the store it may write into alongside (None where nothing
    is stored: no cache, or one that cannot take a lock). ``save`` may raise
    ``CacheWriteError``: logged, and the built object returned. ``refuse`` (offline
    mode) is called instead of any build, and must raise.
    """
    if store is None:
        if refuse is not None:
            refuse()
        return build(None)
    found = load(store)
    if found is not None:
        return found
    if refuse is not None:
        refuse()
    log.info("%s cache miss: %s", what, store.explain_miss(key, factors))
    try:
        lock = store.lock(key)
        lock.__enter__()
    except CacheWriteError as exc:  # no lock file: a read-only cache
        log.warning("cache %s cannot take a lock (%s); building without storing", store.root, exc)
        return build(None)
    try:
        # another process (or, with a remote tier, machine) may have built it meanwhile
        if store.contains(key) or store.remote is not None:
            found = load(store)
            if found is not None:
                return found
        built = build(store)
        try:
            save(store, built)
        except CacheWriteError as exc:
            log.warning("built %s %s but could not store it: %s", what, key[:12], exc)
        else:
            log.info("%s %s built and stored", what, key[:12])
        return built
    finally:
        lock.__exit__(None, None, None)
