"""The single-file format: header, checksummed JSON index, zstd-compressed payloads.

    magic (12 bytes) | format version (u32 LE) | index length (u64 LE)
    | sha256 of index (32 bytes) | signer's public key (32) | signature (64)
    | sha256 of all the header's bytes before it (32; version 3)
    | index (JSON) | payload bytes ...

Every byte is covered by a check: the header's own sha256 covers its fields and the
signature slot (version 2 had none: a flipped byte of an unsigned file's zero slot read
as a signature by a key made of zeros), the index sha256 the index, and the index each
payload. A public key of zeros means unsigned, and then the signature must be zeros too.

The index holds the manifest and, per payload digest, its offset, stored size, raw
size and the sha256 of the stored bytes. Nothing is read past what the header and index
commit to: the file must be a regular file, the index length is bounded by the file, the
index must match its sha256, every payload must lie inside the file and match its
stored sha256, and decompression is bounded by the raw size (see ``_payloads``). The
signature slot (all zeros when unsigned) signs the index digest; it is checked against
the trusted keys, if any, before anything is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from precompile.cache import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Signature,
    atomic_file,
    check_own_signature,
    check_payload_size,
    check_signature,
    compress,
    decode_json,
    decompress,
    read_bounded,
    sha256_hex,
    sign_digest,
)

from ._errors import CorruptArtifactError, IncompatibleArtifactError, InvalidOptionError
from ._manifest import Manifest
from ._payloads import LazyPayloads, PayloadStore

MAGIC = b"\x93PRECOMPILE\n"
BINARY_VERSION = 3  # 2: a signature slot in the header; 3: the header's own sha256
_FIELDS = struct.Struct(f"<12sIQ32s{PUBLIC_KEY_BYTES}s{SIGNATURE_BYTES}s")
_HEADER_V2 = _FIELDS
HEADER_SIZE = _FIELDS.size + 32
_NO_KEY = bytes(PUBLIC_KEY_BYTES)
_MAX_INDEX = 256 << 20
_MAX_FILE = 1 << 40


def write_binary(
    path: str,
    manifest: Manifest,
    payloads: PayloadStore,
    signing_key: Any = None,
    model: Mapping[str, Any] | None = None,
    more: Sequence[tuple[Manifest, PayloadStore]] = (),
) -> None:
    """Write an artifact file; ``model`` (a compiled model's plan) rides in the index, so
    the index digest, and a signature over it, cover it too. ``more``: the graphs of a
    compiled model's pieces (their manifests ride in its plan), whose payloads join the
    table (each once)."""
    if os.path.isdir(path):
        raise InvalidOptionError(
            f"path {path!r} is a directory; format='binary' writes one file (use "
            "format='unpacked' for a directory)"
        )
    blobs: list[bytes] = []
    table: dict[str, dict[str, Any]] = {}
    offset = 0
    sources = [(manifest, payloads), *more]
    wanted = {d: store for m, store in reversed(sources) for d in m.payload_digests}
    for digest, store in wanted.items():
        raw = store.read(digest)
        stored = compress(raw)
        table[digest] = {
            "offset": offset,
            "size": len(stored),
            "raw_size": len(raw),
            "stored_sha256": sha256_hex(stored),
        }
        blobs.append(stored)
        offset += len(stored)
    document: dict[str, Any] = {
        "manifest": manifest.to_json(),
        "payloads": table,
        "compression": "zstd",
    }
    if model is not None:
        document["model"] = dict(model)
    index = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    index_digest = bytes.fromhex(sha256_hex(index))
    with atomic_file(path, 0o644) as handle:
        handle.write(_header(len(index), index_digest, signing_key))
        handle.write(index)
        for blob in blobs:
            handle.write(blob)


def pack_header(index_length: int, index_digest: bytes, public: bytes, signature: bytes) -> bytes:
    """A version-3 header: its fields, then the sha256 of them."""
    fields = _FIELDS.pack(MAGIC, BINARY_VERSION, index_length, index_digest, public, signature)
    return fields + bytes.fromhex(sha256_hex(fields))


def _header(index_length: int, index_digest: bytes, signing_key: Any) -> bytes:
    if signing_key is None:
        public, signature = bytes(PUBLIC_KEY_BYTES), bytes(SIGNATURE_BYTES)
    else:
        signed = sign_digest(index_digest, signing_key)
        public, signature = signed.public_key, signed.signature
    return pack_header(index_length, index_digest, public, signature)


def sign_binary(path: str, signing_key: Any) -> Signature:
    """Sign an existing binary artifact in place (the header's signature slot; a
    version-2 file gets a version-3 header)."""
    view, header, start = _open(path)
    _, _, index_length, index_digest, _, _ = header
    _read_index(view, start, index_length, index_digest, f"artifact {path!r}")
    new_header = _header(index_length, index_digest, signing_key)
    with atomic_file(path, 0o644) as handle:
        handle.write(new_header)
        handle.write(memoryview(view)[start:])
    _, _, _, _, public, signature = _FIELDS.unpack_from(new_header)
    return Signature(public, signature)


def _open(path: str) -> tuple[bytes, tuple[Any, ...], int]:
    """The file's bytes (a regular file, read once: no mapping another writer could
    truncate under us), its parsed header fields, and where the index starts."""
    where = f"artifact {path!r}"
    if os.path.isdir(path):
        raise InvalidOptionError(f"{path!r} is a directory; load it with format='unpacked'")
    data = read_bounded(path, _MAX_FILE, where=where)
    if len(data) < _FIELDS.size:
        raise CorruptArtifactError(f"{where} is too short to be a precompile artifact")
    header = _FIELDS.unpack_from(data)
    magic, version, public, signature = header[0], header[1], header[4], header[5]
    if magic != MAGIC:
        raise CorruptArtifactError(f"{where} is not a precompile artifact (bad magic)")
    if version == BINARY_VERSION:
        if len(data) < HEADER_SIZE:
            raise CorruptArtifactError(f"{where} is too short to be a precompile artifact")
        if sha256_hex(data[: _FIELDS.size]) != data[_FIELDS.size : HEADER_SIZE].hex():
            raise CorruptArtifactError(
                f"{where} header fails its sha256 check (a byte of its fields or of its "
                "signature slot changed)"
            )
        start = HEADER_SIZE
    elif version == 2:  # no header digest: read as before, its slot checked below
        start = _HEADER_V2.size
    else:
        raise IncompatibleArtifactError(
            f"{where} has binary format version {version}; this precompile reads versions 2 "
            f"and {BINARY_VERSION} (the file is corrupt, or was written by another "
            "precompile: recompile, or load with the precompile that wrote it)"
        )
    if public == _NO_KEY and signature != bytes(SIGNATURE_BYTES):
        raise CorruptArtifactError(
            f"{where} is unsigned (no public key) but its signature slot is not empty: "
            "the header is corrupt"
        )
    return data, header, start


def _read_index(view: bytes, start: int, length: int, digest: bytes, where: str) -> tuple[Any, int]:
    if length > min(len(view) - start, _MAX_INDEX):
        raise CorruptArtifactError(f"{where} is truncated or its index length is absurd")
    index_bytes = view[start : start + length]
    if sha256_hex(index_bytes) != digest.hex():
        raise CorruptArtifactError(f"{where} index fails its sha256 check")
    return decode_json(index_bytes, f"{where} index"), start + length


def _check_table(
    table: Any, digests: Iterable[str], data_length: int, where: str
) -> dict[str, dict[str, Any]]:
    if not isinstance(table, dict):
        raise CorruptArtifactError(f"{where} payload table is malformed")
    total = 0
    for digest in digests:
        entry = table.get(digest)
        if not isinstance(entry, dict) or not all(
            type(entry.get(k)) is int for k in ("offset", "size", "raw_size")
        ):
            raise CorruptArtifactError(f"{where} lacks payload {digest[:12]}")
        if not isinstance(entry.get("stored_sha256"), str):
            raise CorruptArtifactError(f"{where} payload {digest[:12]} has no stored sha256")
        if entry["offset"] < 0 or entry["size"] < 0:
            raise CorruptArtifactError(f"{where} payload {digest[:12]} has absurd sizes")
        check_payload_size(entry["raw_size"], digest, where)
        if entry["offset"] + entry["size"] > data_length:
            raise CorruptArtifactError(f"{where} is truncated (payload {digest[:12]} cut short)")
        total += entry["size"]
    if total != data_length:
        raise CorruptArtifactError(
            f"{where} has {data_length} payload bytes where its index lists {total}"
        )
    return table


def read_binary(
    path: str, trusted: tuple[bytes, ...] | None = None
) -> tuple[Manifest, PayloadStore, Signature | None]:
    manifest, payloads, signature, _ = read_binary_with_model(path, trusted)
    return manifest, payloads, signature


def read_binary_with_model(
    path: str, trusted: tuple[bytes, ...] | None = None
) -> tuple[Manifest, PayloadStore, Signature | None, Any]:
    """``read_binary`` plus the index's model plan (None for a graph artifact), not yet
    validated (the runtime's model module validates it)."""
    where = f"artifact {path!r}"
    view, header, start = _open(path)
    _, _, index_length, index_digest, public, signature_bytes = header
    index, data_start = _read_index(view, start, index_length, index_digest, where)
    signature = None if public == _NO_KEY else Signature(public, signature_bytes)
    if trusted is None:
        check_own_signature(index_digest, signature, where)
    check_signature(index_digest, signature, trusted, where)
    if not isinstance(index, dict) or "manifest" not in index or "payloads" not in index:
        raise CorruptArtifactError(f"{where} index is malformed (no manifest or payload table)")
    manifest = Manifest.from_json(index["manifest"])
    payload_view = memoryview(view)[data_start:]
    listed = index["payloads"]
    if not isinstance(listed, dict) or not all(isinstance(d, str) and len(d) == 64 for d in listed):
        raise CorruptArtifactError(f"{where} payload table is malformed")
    missing = [d for d in manifest.payload_digests if d not in listed]
    if missing:
        raise CorruptArtifactError(f"{where} lacks payload {missing[0][:12]}")
    # every payload the table lists: this graph's and, in a compiled model, its pieces'
    table = _check_table(listed, list(listed), len(payload_view), where)
    for digest in table:
        entry = table[digest]
        stored = payload_view[entry["offset"] : entry["offset"] + entry["size"]]
        if sha256_hex(stored) != entry["stored_sha256"]:
            raise CorruptArtifactError(f"{where} payload {digest[:12]} fails its sha256 check")

    def fetch(digest: str) -> bytes:
        entry = table[digest]
        stored = payload_view[entry["offset"] : entry["offset"] + entry["size"]]
        return decompress(stored, entry["raw_size"], digest, where)

    return manifest, LazyPayloads(fetch, holds=table.__contains__), signature, index.get("model")
