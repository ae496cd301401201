"""Payload bytes: where an artifact's payloads come from (memory, a binary file, an
unpacked dir, the cache). Every store hands out bytes only after checking them against
their sha256 digest, so nothing is unpickled or loaded from bytes that are not exactly
what was saved (the checked reads and decompression themselves are ``precompile.cache._bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from precompile.cache import sha256_hex

from ._errors import CorruptArtifactError


class PayloadStore(Protocol):
    def read(self, digest: str) -> bytes:
        """The verified payload bytes for ``digest``."""

    def edited_source(self, digest: str) -> str | None:
        """Generated code the user edited in place of the payload's own, if any."""

    def has(self, digest: str) -> bool:
        """Whether the store holds ``digest`` (True where it cannot tell before a read)."""


class MemoryPayloads:
    """Payloads held in memory, as a fresh compile produces them."""

    def __init__(self, payloads: Mapping[str, bytes]) -> None:
        self._payloads = dict(payloads)

    def read(self, digest: str) -> bytes:
        data = self._payloads[digest]
        if sha256_hex(data) != digest:
            raise CorruptArtifactError(f"payload {digest[:12]} changed in memory")
        return data

    def edited_source(self, digest: str) -> str | None:
        return None

    def has(self, digest: str) -> bool:
        return digest in self._payloads


class LazyPayloads:
    """Payloads verified and decoded on first use by ``fetch`` (for files on disk)."""

    def __init__(
        self,
        fetch: Callable[[str], bytes],
        edited: Callable[[str], str | None] | None = None,
        holds: Callable[[str], bool] | None = None,
    ) -> None:
        self._fetch = fetch
        self._edited = edited
        self._holds = holds

    def read(self, digest: str) -> bytes:
        data = self._fetch(digest)
        if sha256_hex(data) != digest:
            raise CorruptArtifactError(
                f"payload {digest[:12]} does not match its sha256; the artifact is corrupt"
            )
        return data

    def edited_source(self, digest: str) -> str | None:
        return self._edited(digest) if self._edited else None

    def has(self, digest: str) -> bool:
        return self._holds(digest) if self._holds else True


class OverlayPayloads:
    """``extra`` payloads (an artifact's sources rewritten in memory) over ``base``."""

    def __init__(self, extra: Mapping[str, bytes], base: PayloadStore) -> None:
        self._extra = MemoryPayloads(extra)
        self._base = base

    def read(self, digest: str) -> bytes:
        if self._extra.has(digest):
            return self._extra.read(digest)
        return self._base.read(digest)

    def edited_source(self, digest: str) -> str | None:
        return self._base.edited_source(digest)

    def has(self, digest: str) -> bool:
        return self._extra.has(digest) or self._base.has(digest)
