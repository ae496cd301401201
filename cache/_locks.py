"""The cache's locks and the one order they are taken in.

Lock order (never take a lock above one you hold):

1. ``locks/<key>.lock``  exclusive, per key: single flight. Held by ``get_or_create``
   while it compiles, so of N processes missing a key, one compiles and the rest wait
   and then read its entry. A reader (``get``) takes no lock.
2. ``locks/gc.lock``     shared by every writer while it writes blobs and an entry;
   exclusive for ``prune`` and ``clear``. So collection never runs while a write is in
   flight, and never deletes the blobs of an entry about to be written. ``prune`` takes
   no key lock: evicting an entry is one unlink, and a reader that loses the race
   sees a miss.
3. ``locks/stats.lock``  exclusive, for the counters file.

All are ``flock`` locks: the kernel releases them when their holder dies, so a process
killed with SIGKILL blocks nobody. Lock files are only created, never deleted (deleting
one while held would split the lock in two).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from filelock import FileLock, Timeout

from ._errors import CacheWriteError

__all__ = ["Timeout", "exclusive", "shared_or_exclusive"]

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the gc lock is exclusive for everyone
    fcntl = None  # type: ignore[assignment]

_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def _unwritable(exc: OSError, path: str) -> CacheWriteError:
    return CacheWriteError(
        exc.errno or 0, f"cannot create lock file {path} ({exc.strerror}); the cache is read-only"
    )


@contextmanager
def exclusive(path: str, timeout: float) -> Iterator[None]:
    """The exclusive lock at ``path`` (a key lock or the stats lock)."""
    try:
        lock = FileLock(path, timeout=timeout, mode=0o600)
        lock.acquire()
    except Timeout:
        raise
    except OSError as exc:
        if exc.errno in _READ_ONLY:
            raise _unwritable(exc, path) from None
        raise
    try:
        yield
    finally:
        lock.release()


@contextmanager
def shared_or_exclusive(path: str, *, exclusive: bool, timeout: float) -> Iterator[None]:
    """The gc lock: shared for writers, exclusive for collection."""
    if fcntl is None:  # pragma: no cover
        with globals()["exclusive"](path, timeout):
            yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        if exc.errno in _READ_ONLY:
            raise _unwritable(exc, path) from None
        raise
    try:
        operation = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, operation | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Timeout(path) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
