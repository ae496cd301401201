"""The directory format: a readable manifest.json and one folder per distinct variant.

    path/manifest.json                      manifest plus the size of each payload file
    path/signature.json                     optional: a signature over manifest.json
    path/variants/<digest>/payload.bin      the variant (upstream's bundled entry, pickled)
    path/variants/<digest>/output_code.py   its generated forward code
    path/kernels/<digest>.so                a built C++ kernel the variants import

Every file is opened relative to the artifact's directory without following symbolic
links (nothing outside the directory is read), must be a regular file of the size the
manifest gives, and is checked against its sha256 before use. ``output_code.py`` is the
one file meant for hands: an edited copy runs only when the load opts in
(``run_edited_code=True``), and then with a WARNING; otherwise the edit is ignored, also
with a WARNING. With trusted keys configured, edits never run (they are not signed).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
from typing import Any

from precompile.cache import (
    TEMP_PREFIX,
    Signature,
    check_payload_size,
    check_signature,
    decode_json,
    hold,
    read_bounded,
    sha256_hex,
    sign_digest,
    symlink_refused,
)

from . import _torch_adapter as adapter
from ._errors import (
    ArtifactAccessError,
    CorruptArtifactError,
    InvalidOptionError,
    UntrustedArtifactError,
)
from ._manifest import Manifest
from ._payloads import LazyPayloads, PayloadStore

log = logging.getLogger("precompile.runtime")
MANIFEST = "manifest.json"
SIGNATURE = "signature.json"
PAYLOAD = "payload.bin"
CODE = "output_code.py"
_MAX_MANIFEST = 64 << 20
_MAX_CODE = 64 << 20


def write_unpacked(
    path: str, manifest: Manifest, payloads: PayloadStore, signing_key: Any = None
) -> None:
    if not path:
        raise InvalidOptionError("the path to write is empty; name a directory")
    if os.path.isfile(path):
        raise InvalidOptionError(f"path {path!r} is a file; format='unpacked' writes a directory")
    if os.path.exists(path) and not os.path.isdir(path):  # a device, a FIFO, a socket
        raise InvalidOptionError(
            f"path {path!r} exists and is neither a directory nor a file; format='unpacked' "
            "writes a directory: choose another path"
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    held = os.open(staging, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        hold(held)  # in use until swapped into place (see remove_abandoned_temps)
        files: dict[str, dict[str, object]] = {}
        sources = _lean_sources(manifest)
        for digest in manifest.graph_digests:
            raw = payloads.read(digest)
            folder = os.path.join(staging, "variants", digest)
            os.makedirs(folder)
            with open(os.path.join(folder, PAYLOAD), "wb") as handle:
                handle.write(raw)
            code = payloads.edited_source(digest)
            if code is None and digest in sources:
                code = payloads.read(sources[digest]).decode("utf-8")
            elif code is None:
                code = adapter.variant_source_code(raw)
            with open(os.path.join(folder, CODE), "w", encoding="utf-8") as handle:
                handle.write(code)
            files[digest] = {"file": _payload_file(digest), "size": len(raw)}
        for digest in _binary_digests(manifest):
            raw = payloads.read(digest)
            os.makedirs(os.path.join(staging, "kernels"), exist_ok=True)
            with open(os.path.join(staging, _kernel_file(digest)), "wb") as handle:
                handle.write(raw)
            files[digest] = {"file": _kernel_file(digest), "size": len(raw)}
        document = manifest.to_json()
        document["payload_files"] = files
        text = (json.dumps(document, indent=2) + "\n").encode()
        with open(os.path.join(staging, MANIFEST), "wb") as handle:
            handle.write(text)
        if signing_key is not None:
            _write_signature(staging, sign_digest(bytes.fromhex(sha256_hex(text)), signing_key))
        os.chmod(staging, 0o755)
        _swap_into_place(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(held)


def _binary_digests(manifest: Manifest) -> tuple[str, ...]:
    """The kernel binaries kept under ``kernels/``: built C++ kernels and Triton cubins."""
    return tuple(dict.fromkeys((*manifest.kernel_digests, *manifest.triton_digests)))


def _lean_sources(manifest: Manifest) -> dict[str, str]:
    """Graph payload digest -> the digest of its lean source (the same text as its
    ``output_code.py``, which is where this format keeps it)."""
    return {v.payload: v.lean.source for v in manifest.variants if v.lean is not None}


def _without_lean(manifest: Manifest, graphs: set[str]) -> Manifest:
    """``manifest`` with the variants of ``graphs`` on upstream's path."""
    variants = tuple(
        dataclasses.replace(v, lean=None) if v.payload in graphs else v for v in manifest.variants
    )
    return dataclasses.replace(manifest, variants=variants)


def _write_signature(directory: str, signature: Signature) -> None:
    with open(os.path.join(directory, SIGNATURE), "w", encoding="utf-8") as handle:
        json.dump(signature.to_json(), handle, indent=2)
        handle.write("\n")


def sign_unpacked(path: str, signing_key: Any) -> Signature:
    """Sign an existing unpacked artifact (writes ``signature.json``)."""
    directory = _open_dir(path, None, path)
    try:
        text = read_bounded(MANIFEST, _MAX_MANIFEST, follow=False, dir_fd=directory,
                            where=f"{path}/{MANIFEST}")  # fmt: skip
    finally:
        os.close(directory)
    signature = sign_digest(bytes.fromhex(sha256_hex(text)), signing_key)
    tmp = os.path.join(path, SIGNATURE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(signature.to_json(), handle, indent=2)
        handle.write("\n")
    os.replace(tmp, os.path.join(path, SIGNATURE))
    return signature


def _payload_file(digest: str) -> str:
    return f"variants/{digest}/{PAYLOAD}"


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


def _open_dir(name: str, dir_fd: int | None, where: str) -> int:
    """A descriptor of directory ``name`` (relative to ``dir_fd``), never via a symlink."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    if dir_fd is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError as exc:
        raise ArtifactAccessError(
            f"{where} exists but this user may not open it ({exc.strerror}); check its permissions"
        ) from None
    except FileNotFoundError:
        if dir_fd is None:
            raise InvalidOptionError(f"{where!r} does not exist") from None
        raise CorruptArtifactError(f"{where} is missing") from None
    except NotADirectoryError:
        if dir_fd is not None and _is_link(name, dir_fd):
            raise symlink_refused(where) from None
        if dir_fd is None:
            raise InvalidOptionError(
                f"{where!r} is not a directory; an unpacked artifact is a directory "
                "(load a single file with format='binary')"
            ) from None
        raise CorruptArtifactError(f"{where} is not a directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise symlink_refused(where) from None
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _read_relative(root: int, relative: str, limit: int, where: str) -> bytes:
    """Read ``relative`` (a/b/c) under the directory ``root`` with no symlink followed."""
    parts = relative.split("/")
    fds: list[int] = []
    try:
        current = root
        for part in parts[:-1]:
            current = _open_dir(part, current, f"{where}/{part}")
            fds.append(current)
        try:
            return read_bounded(parts[-1], limit, follow=False, dir_fd=current,
                                where=f"{where}/{relative}")  # fmt: skip
        except FileNotFoundError:
            raise CorruptArtifactError(f"{where} is missing {relative}") from None
    finally:
        for fd in fds:
            os.close(fd)


def read_unpacked(
    path: str, trusted: tuple[bytes, ...] | None = None, *, run_edited_code: bool = False
) -> tuple[Manifest, PayloadStore, Signature | None]:
    where = f"artifact {path!r}"
    if trusted is not None and run_edited_code:
        raise UntrustedArtifactError(
            "run_edited_code=True cannot be combined with trusted keys: edited code is not "
            "signed, so it would run unchecked"
        )
    root = _open_dir(path, None, path)
    try:
        mode = os.fstat(root).st_mode
        if not stat.S_ISDIR(mode):  # pragma: no cover - O_DIRECTORY refused it already
            raise InvalidOptionError(f"{path!r} is not a directory")
        raw_manifest = _read_relative(root, MANIFEST, _MAX_MANIFEST, where)
        signature = _read_signature(root, where)
        check_signature(bytes.fromhex(sha256_hex(raw_manifest)), signature, trusted, where)
        document = decode_json(raw_manifest, f"{where} {MANIFEST}")
        manifest = Manifest.from_json(document)
        sizes = _payload_sizes(document, manifest, where)
        relative: dict[str, str] = {d: _payload_file(d) for d in manifest.graph_digests}
        relative.update({d: _kernel_file(d) for d in _binary_digests(manifest)})
        contents = {d: _read_relative(root, name, sizes[d], where) for d, name in relative.items()}
        codes = {}
        for digest in manifest.graph_digests:
            try:
                codes[digest] = _read_relative(
                    root, f"variants/{digest}/{CODE}", _MAX_CODE, where
                ).decode("utf-8")
            except CorruptArtifactError as exc:
                if "is missing" not in str(exc):
                    raise
            except UnicodeDecodeError:
                raise CorruptArtifactError(
                    f"{where} {CODE} of {digest[:12]} is not UTF-8"
                ) from None
    finally:
        os.close(root)
    for digest, data in contents.items():
        if len(data) != sizes[digest]:
            raise CorruptArtifactError(f"{where} file of payload {digest[:12]} has the wrong size")
    # A lean variant's source is its output_code.py: where that file is missing or
    # edited, the variant loads through upstream's path, which handles edits as before.
    lean_sources = _lean_sources(manifest)
    unchanged = set()
    for graph, source in lean_sources.items():
        code = codes.get(graph)
        if code is not None and sha256_hex(code.encode()) == source:
            contents[source] = code.encode()
            unchanged.add(graph)
    if unchanged != set(lean_sources):
        manifest = _without_lean(manifest, set(lean_sources) - unchanged)

    def edited(digest: str) -> str | None:
        code = codes.get(digest)
        if code is None or digest in unchanged:
            return None
        original = adapter.variant_source_code(store.read(digest))
        if code == original:
            return None
        location = f"{path}/variants/{digest}/{CODE}"
        if not run_edited_code:
            log.warning(
                "%s differs from the compiled code and is ignored; load with "
                "run_edited_code=True to run it",
                location,
            )
            return None
        log.warning(
            "running edited generated code %s (sha256 %s) instead of the compiled code",
            location,
            sha256_hex(code.encode())[:12],
        )
        return code

    store = LazyPayloads(contents.__getitem__, edited)
    for digest in manifest.payload_digests:
        store.read(digest)  # checksum every payload now: a corrupt dir fails at load
    return manifest, store, signature


def _read_signature(root: int, where: str) -> Signature | None:
    try:
        raw = read_bounded(SIGNATURE, 1 << 16, follow=False, dir_fd=root,
                           where=f"{where}/{SIGNATURE}")  # fmt: skip
    except FileNotFoundError:
        return None
    return Signature.from_json(decode_json(raw, f"{where} {SIGNATURE}"), where)


def _payload_sizes(document: Any, manifest: Manifest, where: str) -> dict[str, int]:
    files = document.get("payload_files") if isinstance(document, dict) else None
    if not isinstance(files, dict):
        raise CorruptArtifactError(f"{where} manifest lacks its payload_files table")
    sizes = {}
    for digest in (*manifest.graph_digests, *_binary_digests(manifest)):
        entry = files.get(digest)
        size = entry.get("size") if isinstance(entry, dict) else None
        sizes[digest] = check_payload_size(size, digest, f"{where} payload_files")
    return sizes
