"""Artifacts and compiled models in an ArtifactCache: what the compile side stores, and
what it (and ``load_model`` by key) reads back.

The cache stores a document and blobs; here the document is the artifact's manifest (or,
for a compiled model, that manifest and the model's plan) and the blobs are its payloads
(compiled graphs, built kernels), so an entry references exactly
``manifest.payload_digests`` plus its auxiliary blobs. One entry becomes an artifact in
``_artifact.artifact_from_entry`` (what ``CompiledArtifact.load(tag=..., key=...)`` uses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from precompile.cache import ArtifactCache, StoredEntry, cache_to_read

from ._artifact import CompiledArtifact, artifact_from_entry
from ._entry_summary import MODEL_ENTRY
from ._errors import InvalidOptionError


def load_cached(cache: ArtifactCache, key: str) -> tuple[CompiledArtifact, dict[str, bytes]] | None:
    """The artifact stored under ``key`` and its auxiliary blobs, or None on a miss."""
    entry = cache.get(key, lazy=True)
    if entry is None:
        return None
    return artifact_from_entry(entry), dict(entry.aux)


def load_cached_model(cache: ArtifactCache | None, key: str) -> tuple[CompiledArtifact, Any] | None:
    """The compiled graph and the raw model plan stored under ``key``, or None."""

    entry = cache_to_read(cache).get(key, lazy=True)  # payloads read as variants load
    if entry is None:
        return None
    document = entry.document
    if not isinstance(document, dict) or document.get("kind") != MODEL_ENTRY:
        raise InvalidOptionError(
            f"cache entry {key[:12]} is not a compiled model (a graph: load it with "
            "CompiledArtifact.load)"
        )
    graph = _with_document(entry, document.get("manifest"))
    return artifact_from_entry(graph), document.get("model")


def store_model(
    cache: ArtifactCache,
    key: str,
    artifact: CompiledArtifact,
    plan: Mapping[str, Any],
    factors: Mapping[str, str],
    about: Mapping[str, str] | None = None,
    pieces: Sequence[CompiledArtifact] = (),
) -> None:
    """Store a compiled model under ``key``: its graph's artifact and its plan (``about``:
    what it is, for ``cache ls``; see ``_entry_summary``), with its pieces' payloads."""
    manifest = artifact.manifest
    blobs = {d: artifact.payload_bytes(d) for d in manifest.payload_digests}
    for piece in pieces:  # a compiled model's traces at lengths below 2
        blobs.update({d: piece.payload_bytes(d) for d in piece.manifest.payload_digests})
    document = {"kind": MODEL_ENTRY, "manifest": manifest.to_json(), "model": dict(plan)}
    cache.put(key, document, blobs, factors, about=about)


def _with_document(entry: StoredEntry, document: Any) -> StoredEntry:
    """The same entry with ``document`` as its document (a model entry's manifest)."""
    return StoredEntry(entry.key, document, entry.blobs, entry.aux, entry.factors)


def store_artifact(
    cache: ArtifactCache,
    key: str,
    artifact: CompiledArtifact,
    factors: Mapping[str, str],
    aux: Mapping[str, bytes] | None = None,
    about: Mapping[str, str] | None = None,
) -> None:
    """Store ``artifact`` under ``key`` (raises ``CacheWriteError`` if it cannot);
    ``about``: what it is, for ``cache ls`` (see ``_entry_summary``)."""
    manifest = artifact.manifest
    blobs = {d: artifact.payload_bytes(d) for d in manifest.payload_digests}
    cache.put(key, manifest.to_json(), blobs, factors, aux, about=about)
    artifact.cache_key = key
