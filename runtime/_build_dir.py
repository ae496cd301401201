"""Where this process's loaded and compiled code lives: one owner of that directory.

Loading an artifact writes its generated wrapper modules, and on CPU its built kernels,
into a directory that is then imported from. It is private to the process (a fresh
temp dir, removed at exit by the process that made it) unless
``$PRECOMPILE_BUILD_DIR`` names a shared one, which must be owned by this user and
writable by nobody else, since whatever it holds gets imported.

Fork safety (as filelock resets its per-process state): a forked child does not reuse
its parent's directory, because the parent removes it at exit; the child makes its own
on first use, and never removes its parent's.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading

from ._errors import InvalidOptionError, UnsafeCacheError

_lock = threading.Lock()
_directory: str | None = None
_owner_pid: int | None = None


def _remove_if_ours(path: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def check_private(path: str, what: str) -> None:
    """Refuse a directory we would import code from if another user could write it."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheError(f"{what} {path!r} must be a directory, not a link or a file")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise UnsafeCacheError(
            f"{what} {path!r} is owned by uid {info.st_uid} or writable by group/others "
            f"(mode {oct(info.st_mode & 0o777)}); code imported from it could be someone "
            "else's: use a directory of your own with mode 0700"
        )


def build_dir() -> str:
    """This process's directory for generated modules and built kernels."""
    global _directory, _owner_pid
    pid = os.getpid()
    with _lock:
        if _directory is not None and _owner_pid == pid:
            return _directory
        configured = os.environ.get("PRECOMPILE_BUILD_DIR")
        if configured:
            try:  # the last component only: a typo never creates a tree of directories
                os.mkdir(configured, mode=0o700)
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise InvalidOptionError(
                    f"PRECOMPILE_BUILD_DIR={configured!r}: its parent directory does not "
                    "exist (only the directory itself is created, private to this user)"
                ) from None
            check_private(configured, "PRECOMPILE_BUILD_DIR")
            _directory = configured
        else:
            _directory = tempfile.mkdtemp(prefix=f"precompile-build-{pid}-")
            atexit.register(_remove_if_ours, _directory, pid)
        _owner_pid = pid
        return _directory


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
