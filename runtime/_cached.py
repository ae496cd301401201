"""Artifacts in an ArtifactCache: the runtime turns entries into artifacts and back.

The cache stores a document and blobs; here the document is the artifact's manifest and
the blobs are its payloads (compiled graphs, built kernels), so an entry references
exactly ``manifest.payload_digests`` plus its auxiliary blobs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._environment import check_compatible
from ._errors import CorruptArtifactError, InvalidOptionError
from ._manifest import Manifest
from ._payloads import MemoryPayloads

if TYPE_CHECKING:
    from cache import ArtifactCache, StoredEntry

    from ._artifact import CompiledArtifact

log = logging.getLogger("precompile.runtime")


def artifact_from_entry(entry: StoredEntry) -> CompiledArtifact:
    from ._artifact import CompiledArtifact

    where = f"cache entry {entry.key[:12]}"
    manifest = Manifest.from_json(entry.document)
    missing = [d for d in manifest.payload_digests if d not in entry.blobs]
    if missing:
        raise CorruptArtifactError(f"{where} lacks payload {missing[0][:12]}")
    check_compatible(manifest.environment, where)
    artifact = CompiledArtifact(manifest, MemoryPayloads(entry.blobs))
    artifact.cache_key = entry.key
    return artifact


def cache_to_read(cache: Any) -> ArtifactCache:
    """``cache=`` of a load by key or tag: None the default cache, a path or an
    ArtifactCache that one (False, no cache, cannot be read from)."""
    from cache import resolve_cache

    store = resolve_cache(cache)
    if store is None:
        raise InvalidOptionError(
            "loading by key or tag needs a cache: pass None, a path or an ArtifactCache"
        )
    return store


def load_cached(cache: ArtifactCache, key: str) -> tuple[CompiledArtifact, dict[str, bytes]] | None:
    """The artifact stored under ``key`` and its auxiliary blobs, or None on a miss."""
    entry = cache.get(key)
    if entry is None:
        return None
    return artifact_from_entry(entry), dict(entry.aux)


MODEL_ENTRY = "precompile-model"


def load_cached_model(cache: ArtifactCache | None, key: str) -> tuple[CompiledArtifact, Any] | None:
    """The compiled graph and the raw model plan stored under ``key``, or None."""

    entry = cache_to_read(cache).get(key)
    if entry is None:
        return None
    document = entry.document
    if not isinstance(document, dict) or document.get("kind") != MODEL_ENTRY:
        raise CorruptArtifactError(f"cache entry {key[:12]} is not a compiled model")
    graph = _with_document(entry, document.get("manifest"))
    return artifact_from_entry(graph), document.get("model")


def store_model(
    cache: ArtifactCache,
    key: str,
    artifact: CompiledArtifact,
    plan: Mapping[str, Any],
    factors: Mapping[str, str],
) -> None:
    manifest = artifact.manifest
    blobs = {d: artifact.payload_bytes(d) for d in manifest.payload_digests}
    document = {"kind": MODEL_ENTRY, "manifest": manifest.to_json(), "model": dict(plan)}
    cache.put(key, document, blobs, factors)


def _with_document(entry: StoredEntry, document: Any) -> StoredEntry:
    """The same entry with ``document`` as its document (a model entry's manifest)."""
    from cache import StoredEntry as Entry

    return Entry(entry.key, document, entry.blobs, entry.aux, entry.factors)


def store_artifact(
    cache: ArtifactCache,
    key: str,
    artifact: CompiledArtifact,
    factors: Mapping[str, str],
    aux: Mapping[str, bytes] | None = None,
) -> None:
    """Store ``artifact`` under ``key`` (raises ``CacheWriteError`` if it cannot)."""
    manifest = artifact.manifest
    blobs = {d: artifact.payload_bytes(d) for d in manifest.payload_digests}
    cache.put(key, manifest.to_json(), blobs, factors, aux)
    artifact.cache_key = key
