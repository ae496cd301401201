"""Reading and listing the cache's files without trusting them.

A cache entry is code that will run, so every file is opened without following a
symbolic link, checked on the opened descriptor (``fstat``: no window between the check
and the read), and refused if another user owns it or others may write it. Listing
tolerates files that vanish mid-scan (other processes evict and write concurrently).
"""

from __future__ import annotations

import os
import stat

from ._bytes import read_fd
from ._errors import CacheRootError, CorruptArtifactError, UnsafeCacheError

FOREIGN_HINT = "fix its ownership, or pass trust_foreign=True"


def check_owner(info: os.stat_result, path: str) -> None:
    """Refuse what another user owns or others may write."""
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise UnsafeCacheError(
            f"{path} is owned by uid {info.st_uid} or writable by group/others "
            f"(mode {oct(info.st_mode & 0o777)}); loading it would run code another user "
            f"could have written: {FOREIGN_HINT}"
        )


def check_directory(path: str, trust_foreign: bool) -> None:
    """A cache directory must be a real directory (no link), ours, and not writable by
    others (someone who can write it can swap any file in it)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheError(f"cache directory {path} is a link or not a directory")
    if not trust_foreign:
        check_owner(info, f"cache directory {path}")


def check_root(path: str, trust_foreign: bool) -> None:
    """The cache root is checked like the directories in it: whoever can write it can
    swap the whole layout under it for one of theirs. A link to the root is followed
    (where the cache lives is the caller's choice); the directory it names must be ours,
    and not writable by others unless sticky (a tmpfs mount: others may add names there,
    never rename or remove ours, and every directory of the layout is checked too)."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheRootError(
            f"cache root {path} is not a directory; a cache root must be one (a new path is "
            "made into one)"
        )
    ours_and_sticky = info.st_uid == os.getuid() and info.st_mode & stat.S_ISVTX
    if not trust_foreign and not ours_and_sticky:
        check_owner(info, f"cache root {path}")


def open_checked(path: str, trust_foreign: bool) -> int:
    """A descriptor of a cache file: a regular file, not through a link, checked on the
    opened descriptor. FileNotFoundError means a miss. While it is open, the file's bytes
    stay readable through it even after another process evicts (unlinks) the file."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise UnsafeCacheError(f"{path} is a symbolic link or cannot be opened: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptArtifactError(f"{path} is not a regular file", path=path)
        if not trust_foreign:
            check_owner(info, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_checked(path: str, limit: int, trust_foreign: bool) -> bytes:
    """The bytes of a cache file: a regular file, not through a link, checked on the
    opened descriptor, at most ``limit`` bytes. FileNotFoundError means a miss."""
    fd = open_checked(path, trust_foreign)
    try:
        return read_fd(fd, limit, path)
    finally:
        os.close(fd)


def listing(directory: str) -> list[str]:
    """Names in ``directory``, or none if it vanished."""
    try:
        return sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def size_of(path: str) -> int:
    """A file's size, or 0 if it vanished."""
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def mtime_of(path: str) -> float | None:
    try:
        return os.lstat(path).st_mtime
    except FileNotFoundError:
        return None


def remove(path: str) -> bool:
    """Unlink ``path``; False if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
