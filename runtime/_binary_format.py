"""The single-file format: header, checksummed JSON index, zstd-compressed payloads.

    magic (12 bytes) | format version (u32 LE) | index length (u64 LE)
    | sha256 of index (32 bytes) | index (JSON) | payload bytes ...

The index holds the manifest and, per payload digest, its offset, stored size, raw
size and the sha256 of the stored bytes. Sizes are checked against the file length on
open (truncation), stored bytes are hashed before decompressing, and the decompressed
bytes must hash to the payload's digest before anyone unpickles them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from typing import Any

import zstandard

from ._errors import CorruptArtifactError, IncompatibleArtifactError, InvalidOptionError
from ._manifest import Manifest, decode_json
from ._payloads import LazyPayloads, PayloadStore, atomic_file, sha256_hex

MAGIC = b"\x93PRECOMPILE\n"
BINARY_VERSION = 1
_HEADER = struct.Struct("<12sIQ32s")
_ZSTD_LEVEL = 3


def write_binary(path: str, manifest: Manifest, payloads: PayloadStore) -> None:
    if os.path.isdir(path):
        raise InvalidOptionError(
            f"path {path!r} is a directory; format='binary' writes one file (use "
            "format='unpacked' for a directory)"
        )
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    blobs: list[bytes] = []
    table: dict[str, dict[str, Any]] = {}
    offset = 0
    for digest in manifest.payload_digests:
        raw = payloads.read(digest)
        stored = compressor.compress(raw)
        table[digest] = {
            "offset": offset,
            "size": len(stored),
            "raw_size": len(raw),
            "stored_sha256": sha256_hex(stored),
        }
        blobs.append(stored)
        offset += len(stored)
    index = json.dumps(
        {"manifest": manifest.to_json(), "payloads": table, "compression": "zstd"},
        separators=(",", ":"),
    ).encode()
    header = _HEADER.pack(MAGIC, BINARY_VERSION, len(index), bytes.fromhex(sha256_hex(index)))
    with atomic_file(path) as handle:
        handle.write(header)
        handle.write(index)
        for blob in blobs:
            handle.write(blob)


def _parse_index(data: bytes, where: str) -> tuple[Manifest, dict[str, dict[str, Any]], int]:
    if len(data) < _HEADER.size:
        raise CorruptArtifactError(f"{where} is too short to be a precompile artifact")
    magic, version, index_length, index_sha = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptArtifactError(f"{where} is not a precompile artifact (bad magic)")
    if version != BINARY_VERSION:
        raise IncompatibleArtifactError(
            f"{where} uses binary format version {version}; this precompile reads "
            f"version {BINARY_VERSION}"
        )
    start = _HEADER.size
    end = start + index_length
    if end > len(data):
        raise CorruptArtifactError(f"{where} is truncated (index cut short)")
    index_bytes = data[start:end]
    if sha256_hex(index_bytes) != index_sha.hex():
        raise CorruptArtifactError(f"{where} index fails its sha256 check")
    index = decode_json(index_bytes, f"{where} index")
    if not isinstance(index, dict) or "manifest" not in index or "payloads" not in index:
        raise CorruptArtifactError(f"{where} index is malformed (no manifest or payload table)")
    return Manifest.from_json(index["manifest"]), index["payloads"], end


def _check_table(
    table: Any, digests: Iterable[str], data_length: int, where: str
) -> dict[str, dict[str, Any]]:
    if not isinstance(table, dict):
        raise CorruptArtifactError(f"{where} payload table is malformed")
    total = 0
    for digest in digests:
        entry = table.get(digest)
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), int) for k in ("offset", "size", "raw_size")
        ):
            raise CorruptArtifactError(f"{where} lacks payload {digest[:12]}")
        if entry["offset"] < 0 or entry["offset"] + entry["size"] > data_length:
            raise CorruptArtifactError(f"{where} is truncated (payload {digest[:12]} cut short)")
        total += entry["size"]
    if total != data_length:
        raise CorruptArtifactError(
            f"{where} has {data_length} payload bytes where its index lists {total}"
        )
    return table


def read_binary(path: str) -> tuple[Manifest, PayloadStore]:
    where = f"artifact {path!r}"
    if os.path.isdir(path):
        raise InvalidOptionError(f"{path!r} is a directory; load it with format='unpacked'")
    with open(path, "rb") as handle:
        data = handle.read()
    manifest, table, data_start = _parse_index(data, where)
    payload_view = memoryview(data)[data_start:]
    table = _check_table(table, manifest.payload_digests, len(payload_view), where)
    for digest in manifest.payload_digests:
        entry = table[digest]
        stored = payload_view[entry["offset"] : entry["offset"] + entry["size"]]
        if sha256_hex(stored) != entry.get("stored_sha256"):
            raise CorruptArtifactError(f"{where} payload {digest[:12]} fails its sha256 check")

    def fetch(digest: str) -> bytes:
        entry = table[digest]
        stored = payload_view[entry["offset"] : entry["offset"] + entry["size"]]
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=entry["raw_size"])
        except zstandard.ZstdError as exc:
            raise CorruptArtifactError(f"{where} payload {digest[:12]}: {exc}") from None
        return bytes(raw)

    return manifest, LazyPayloads(fetch)
