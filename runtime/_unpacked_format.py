"""The directory format: a readable manifest.json and one folder per distinct variant.

    path/manifest.json                      manifest plus a checksum per payload file
    path/variants/<digest>/payload.bin      the variant (upstream's bundled entry, pickled)
    path/variants/<digest>/output_code.py   its generated forward code
    path/kernels/<digest>.so                a built C++ kernel the variants import

``payload.bin`` is checked against its sha256 before it is unpickled. ``output_code.py``
is the one file meant for hands: an edited copy replaces the payload's code on the next
load, as upstream's unpacked format allows, and the load logs that it did so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

from . import _torch_adapter as adapter
from ._errors import CorruptArtifactError, InvalidOptionError
from ._manifest import Manifest, decode_json
from ._payloads import LazyPayloads, PayloadStore, sha256_hex

log = logging.getLogger("precompile.runtime")
MANIFEST = "manifest.json"
PAYLOAD = "payload.bin"
CODE = "output_code.py"


def write_unpacked(path: str, manifest: Manifest, payloads: PayloadStore) -> None:
    if os.path.isfile(path):
        raise InvalidOptionError(f"path {path!r} is a file; format='unpacked' writes a directory")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".precompile-", dir=parent)
    try:
        files: dict[str, dict[str, object]] = {}
        for digest in manifest.graph_digests:
            raw = payloads.read(digest)
            folder = os.path.join(staging, "variants", digest)
            os.makedirs(folder)
            with open(os.path.join(folder, PAYLOAD), "wb") as handle:
                handle.write(raw)
            code = payloads.edited_source(digest) or adapter.variant_source_code(raw)
            with open(os.path.join(folder, CODE), "w", encoding="utf-8") as handle:
                handle.write(code)
            files[digest] = {"file": f"variants/{digest}/{PAYLOAD}", "size": len(raw)}
        for digest in manifest.kernel_digests:
            raw = payloads.read(digest)
            os.makedirs(os.path.join(staging, "kernels"), exist_ok=True)
            with open(os.path.join(staging, _kernel_file(digest)), "wb") as handle:
                handle.write(raw)
            files[digest] = {"file": _kernel_file(digest), "size": len(raw)}
        document = manifest.to_json()
        document["payload_files"] = files
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
            handle.write("\n")
        _swap_into_place(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _kernel_file(digest: str) -> str:
    return f"kernels/{digest}.so"


def _swap_into_place(staging: str, path: str) -> None:
    """Replace ``path`` by the complete ``staging`` dir; the old one goes only after."""
    if not os.path.exists(path):
        os.replace(staging, path)
        return
    if not os.path.isfile(os.path.join(path, MANIFEST)) and os.listdir(path):
        raise InvalidOptionError(
            f"{path!r} exists and is not an unpacked precompile artifact; refusing to replace it"
        )
    retired = tempfile.mkdtemp(prefix=".precompile-old-", dir=os.path.dirname(path) or ".")
    os.rmdir(retired)
    os.replace(path, retired)
    os.replace(staging, path)
    shutil.rmtree(retired, ignore_errors=True)


def read_unpacked(path: str) -> tuple[Manifest, PayloadStore]:
    where = f"artifact {path!r}"
    if not os.path.isdir(path):
        raise InvalidOptionError(
            f"{path!r} is not a directory; an unpacked artifact is a directory "
            "(load a single file with format='binary')"
        )
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path, "rb") as handle:
            raw_manifest = handle.read()
    except FileNotFoundError:
        raise CorruptArtifactError(f"{where} has no {MANIFEST}") from None
    document = decode_json(raw_manifest, f"{where} {MANIFEST}")
    manifest = Manifest.from_json(document)
    files = document.get("payload_files")
    if not isinstance(files, dict):
        raise CorruptArtifactError(f"{where} manifest lacks its payload_files table")
    relative = {d: f"variants/{d}/{PAYLOAD}" for d in manifest.graph_digests}
    relative.update({d: _kernel_file(d) for d in manifest.kernel_digests})
    for name in relative.values():
        if not os.path.isfile(os.path.join(path, name)):
            raise CorruptArtifactError(f"{where} is missing {name}")

    def fetch(digest: str) -> bytes:
        with open(os.path.join(path, relative[digest]), "rb") as handle:
            return handle.read()

    def edited(digest: str) -> str | None:
        if digest not in manifest.graph_digests:
            return None
        code_path = os.path.join(path, "variants", digest, CODE)
        try:
            with open(code_path, encoding="utf-8") as handle:
                code = handle.read()
        except FileNotFoundError:
            return None
        original = adapter.variant_source_code(store.read(digest))
        if code == original:
            return None
        log.info(
            "using edited generated code %s (sha256 %s)", code_path, sha256_hex(code.encode())[:12]
        )
        return code

    store = LazyPayloads(fetch, edited)
    for digest in manifest.payload_digests:
        store.read(digest)  # checksum every payload now: a corrupt dir fails at load
    return manifest, store
