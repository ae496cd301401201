"""Stored bytes, trusted by no reader: sha256 digests, zstd compression and decompression
checked against a digest and a size, bounded reads of regular files, and atomic writes.
The cache stores its blobs with these, the runtime its artifacts' payloads.

Reads and decompression are bounded by sizes an index commits to (and checked against
them), and by a maximum, so a hostile file cannot make a reader allocate without limit:
decompressed bytes are counted and hashed in chunks as they come, and only small
payloads are kept before they are verified.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import zstandard

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: abandoned temps are not told apart
    fcntl = None  # type: ignore[assignment]

from ._errors import (
    ArtifactAccessError,
    CorruptArtifactError,
    InvalidOptionError,
    PayloadLimitError,
)
from ._settings import env_bytes

ZSTD_LEVEL = 3
_CHUNK = 1 << 22


def max_payload_bytes() -> int:
    """The largest payload a load decompresses: ``$PRECOMPILE_MAX_PAYLOAD_BYTES`` or 8 GiB."""
    return env_bytes("PRECOMPILE_MAX_PAYLOAD_BYTES", 8 << 30)


def symlink_refused(where: str) -> CorruptArtifactError:
    """The error for a symbolic link where an artifact's own file was expected."""
    return CorruptArtifactError(f"{where} is a symbolic link; an artifact's files must be its own")


def check_payload_size(raw_size: object, digest: str, where: str) -> int:
    """``raw_size`` as an index commits to it: a non-negative int (else the index is
    corrupt) within the maximum (else ``PayloadLimitError``, naming the setting)."""
    if type(raw_size) is not int or raw_size < 0:
        raise CorruptArtifactError(
            f"{where}: payload {digest[:12]} has an absurd size: {raw_size!r:.20}"
        )
    limit = max_payload_bytes()
    if raw_size > limit:
        raise PayloadLimitError(
            f"{where}: payload {digest[:12]} is {raw_size} bytes, over the {limit}-byte maximum "
            "(raise $PRECOMPILE_MAX_PAYLOAD_BYTES if that is really its size)"
        )
    return raw_size


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def compress(raw: bytes) -> bytes:
    return bytes(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw))


# Payloads up to this size are decompressed once, kept as they are checked; larger ones
# are checked in a first pass that keeps nothing, then decompressed again.
_ONE_PASS_MAX = 64 << 20


def decompress(stored: bytes | memoryview, raw_size: int, digest: str, where: str) -> bytes:
    """The raw bytes of a zstd payload that must hash to ``digest`` and be exactly
    ``raw_size`` long. Chunks are counted and hashed as they come, so a frame that claims
    or produces more than ``raw_size`` bytes is refused at the first chunk past it and a
    ``raw_size`` over the maximum costs nothing. Unverified bytes are held only up to
    ``_ONE_PASS_MAX`` (what one small payload costs anyway): a larger payload is
    verified in a pass that keeps nothing, then decompressed again."""
    check_payload_size(raw_size, digest, where)
    keep = raw_size <= _ONE_PASS_MAX
    try:
        declared = zstandard.get_frame_parameters(stored).content_size
        if declared not in (raw_size, zstandard.CONTENTSIZE_UNKNOWN):
            raise CorruptArtifactError(
                f"{where}: payload {digest[:12]} declares {declared} bytes, its index {raw_size}"
            )
        hasher = hashlib.sha256()
        chunks: list[bytes] = []
        seen = 0
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored)) as reader:
            while True:
                chunk = reader.read(min(_CHUNK, raw_size - seen + 1))
                if not chunk:
                    break
                seen += len(chunk)
                if seen > raw_size:
                    raise CorruptArtifactError(
                        f"{where}: payload {digest[:12]} decompresses past its {raw_size} bytes"
                    )
                hasher.update(chunk)
                if keep:
                    chunks.append(chunk)
        if seen != raw_size or hasher.hexdigest() != digest:
            raise CorruptArtifactError(
                f"{where}: payload {digest[:12]} does not decompress to its sha256 and size"
            )
        if keep:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored)) as reader:
            raw = reader.read(raw_size)
    except zstandard.ZstdError as exc:
        raise CorruptArtifactError(f"{where}: payload {digest[:12]}: {exc}") from None
    if len(raw) != raw_size:  # the same bytes again; a second check costs little
        raise CorruptArtifactError(f"{where}: payload {digest[:12]} changed while read")
    return bytes(raw)


def fails_own_digest(stored: bytes | memoryview, digest: str) -> bool:
    """Whether a stored (zstd) payload is certainly not the one named ``digest``: it is
    not zstd, or what it decompresses to hashes to something else. Judged on its own
    bytes alone, whatever an index says of its size; False where that cannot be told
    (it decompresses past the maximum payload size). Streamed: nothing is kept."""
    limit = max_payload_bytes()
    hasher = hashlib.sha256()
    seen = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored)) as reader:
            while chunk := reader.read(_CHUNK):
                seen += len(chunk)
                if seen > limit:
                    return False
                hasher.update(chunk)
    except zstandard.ZstdError:
        return True
    return hasher.hexdigest() != digest


# -- reading files that a load will run ----------------------------------------------
def open_regular(
    path: str, *, follow: bool = True, dir_fd: int | None = None, where: str | None = None
) -> int:
    """A read-only descriptor of a regular file (``follow=False``: not through a
    symlink). Special files (``/dev/zero``, FIFOs) and directories are refused."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    name = where or path
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    except PermissionError as exc:
        raise ArtifactAccessError(f"{name} cannot be read by this user: {exc.strerror}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise symlink_refused(name) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise InvalidOptionError(f"{name} is not a regular file")
    return fd


def read_fd(fd: int, limit: int, where: str) -> bytes:
    """All of ``fd`` (a regular file), refusing one larger than ``limit`` bytes."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise CorruptArtifactError(f"{where} is {size} bytes, more than the {limit} it may be")
    chunks = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    if len(data) != size or os.read(fd, 1):
        raise CorruptArtifactError(f"{where} changed size while being read")
    return data


def read_bounded(path: str, limit: int, *, follow: bool = True, dir_fd: int | None = None,
                 where: str | None = None) -> bytes:  # fmt: skip
    fd = open_regular(path, follow=follow, dir_fd=dir_fd, where=where)
    try:
        return read_fd(fd, limit, where or path)
    finally:
        os.close(fd)


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


@contextmanager
def atomic_file(path: str, mode: int = 0o600) -> Iterator[IO[bytes]]:
    """Write ``path`` through a temp file in the same directory and ``os.replace``; on
    any failure (a full disk among them) the temp file is removed and ``path`` is as
    it was."""
    if not path:
        raise InvalidOptionError("the path to write is empty; name a file")
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        kind = stat.S_IFREG  # nothing there yet
    if kind != stat.S_IFREG:
        # os.replace would put a file in place of a device, a FIFO or a socket (/dev/null)
        raise InvalidOptionError(
            f"{path!r} exists and is not a regular file ({_KINDS.get(kind, 'a special file')});"
            " a file is written there only in place of a file: choose another path"
        )
    directory = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            hold(handle.fileno())  # in use: see remove_abandoned_temps
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
            os.replace(tmp, path)  # still locked: no cleanup takes it from under the rename
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def hold(fd: int) -> None:
    """Mark a temp file or staging dir (its descriptor) as a write in progress, until the
    descriptor is closed (or its process dies)."""
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a file system without locks (some NFS): the
            fcntl.flock(fd, fcntl.LOCK_EX)  # cleanup cannot lock it either, so leaves it


TEMP_PREFIX = ".precompile-"  # the temp files and staging dirs of writes in progress
_TEMP_NAME = re.compile(r"\.precompile-[A-Za-z0-9_]{8}(\.tmp)?")  # mkstemp's and mkdtemp's
_TEMP_GRACE_S = 60.0  # younger: its writer may not hold its lock yet


def remove_abandoned_temps(directory: str) -> list[str]:
    """Remove the temp files and staging dirs in ``directory`` whose writer died (a save
    killed part way): each writer holds a lock on its own while it writes, so one that
    can be locked is abandoned. Those younger than a minute are left (their writer may
    not have locked them yet), and so is anything else. Returns what went."""
    removed: list[str] = []
    if fcntl is None:
        return removed
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _TEMP_NAME.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if time.time() - info.st_mtime < _TEMP_GRACE_S or not (
                stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)
            ):
                continue
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(path, flags | (os.O_DIRECTORY if stat.S_ISDIR(info.st_mode) else 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its writer holds it
        try:
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
