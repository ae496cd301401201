"""An entry's document as stored (``entries/<key>.json``), locally or on a remote: its
checks, what its signature signs, and the entry it reads back as.

Both tiers read the same bytes and must refuse the same things: the local store and the
remote tier share these checks rather than each keeping its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._bytes import check_payload_size, sha256_hex
from ._entry import StoredEntry, VerifiedBlobs
from ._errors import CorruptArtifactError

MAX_ENTRY_BYTES = 64 << 20
_HEX = frozenset("0123456789abcdef")
ABOUT_ITEMS, ABOUT_NAME, ABOUT_TEXT = 32, 64, 4096  # an entry's ``about``: small, plain


def is_digest(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 64 and set(text) <= _HEX


def is_about(value: Any) -> bool:
    """Whether ``value`` is an entry's ``about``: a small table of plain text."""
    return (
        isinstance(value, dict)
        and len(value) <= ABOUT_ITEMS
        and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= ABOUT_NAME
            and len(v) <= ABOUT_TEXT
            for k, v in value.items()
        )
    )  # fmt: skip


def signed_digest(document: Mapping[str, Any]) -> bytes:
    """What an entry's signature signs: sha256 of its canonical JSON, signature aside."""
    body = {k: v for k, v in document.items() if k != "signature"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return bytes.fromhex(sha256_hex(text.encode()))


def validate(key: str, document: Any) -> None:
    """Raise ``CorruptArtifactError`` unless ``document`` is a well-formed entry of ``key``."""
    if not isinstance(document, dict) or document.get("key") != key:
        raise CorruptArtifactError("entry does not describe its own key")
    blobs, aux = document.get("blobs"), document.get("aux")
    if not isinstance(blobs, dict) or not isinstance(aux, dict):
        raise CorruptArtifactError("entry lacks its blob table")
    for digest, size in blobs.items():
        if not is_digest(digest):
            raise CorruptArtifactError(f"entry lists blob {str(digest)[:12]} oddly")
        check_payload_size(size, digest, f"cache entry {key[:12]}")
    for name, digest in aux.items():
        if not isinstance(name, str) or digest not in blobs:
            raise CorruptArtifactError(f"entry's aux {name!r:.40} names no listed blob")
    if not isinstance(document.get("factors", {}), dict):
        raise CorruptArtifactError("entry's factors are not a table")
    if not is_about(document.get("about", {})):
        raise CorruptArtifactError("entry's about is not a small table of text")


def stored(
    key: str,
    document: Mapping[str, Any],
    blobs: Mapping[str, bytes],
    payloads: VerifiedBlobs | None = None,
) -> StoredEntry:
    """The entry a validated ``document`` and its blobs (raw bytes) read back as."""
    aux_digests = set(document["aux"].values())
    return StoredEntry(
        key=key,
        document=document.get("document"),
        blobs=payloads
        if payloads is not None
        else {d: blobs[d] for d in document["blobs"] if d not in aux_digests},
        aux={name: blobs[d] for name, d in document["aux"].items()},
        factors=document.get("factors", {}),
    )
