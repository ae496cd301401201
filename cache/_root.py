"""Where the cache lives and how its directory tree is laid out (versioned)."""

from __future__ import annotations

import errno
import os

import platformdirs

LAYOUT = "v2"  # v2: entries list their blobs and sizes; the cache never builds artifacts
_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by precompile.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
ROLES = ("entries", "blobs", "locks", "quarantine", "tags")


def resolve_root(root: str | os.PathLike[str] | None) -> str:
    """``root`` argument, else ``$PRECOMPILE_CACHE_DIR``, else the user cache dir."""
    if root is not None:
        return os.path.abspath(os.fspath(root))
    configured = os.environ.get("PRECOMPILE_CACHE_DIR")
    if configured:
        return os.path.abspath(configured)
    return os.path.abspath(platformdirs.user_cache_dir("precompile"))


def layout(root: str) -> dict[str, str]:
    """The layout's directories by role (``base`` is the versioned top)."""
    base = os.path.join(root, LAYOUT)
    return {"base": base, **{role: os.path.join(base, role) for role in ROLES}}


def prepare(root: str) -> tuple[dict[str, str], bool]:
    """Create the layout if missing (mode 0700). Returns the directories and whether
    the cache is writable: a read-only cache (a baked image, a read-only mount) still
    serves the entries it has."""
    dirs = layout(root)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        tag = os.path.join(root, "CACHEDIR.TAG")
        if not os.path.exists(tag):
            with open(tag, "w", encoding="utf-8") as handle:
                handle.write(_TAG)
        for path in dirs.values():
            os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        return dirs, False
    return dirs, os.access(dirs["entries"], os.W_OK) and _writable(dirs["locks"])


def _writable(directory: str) -> bool:
    """Whether files can be created in ``directory`` (root ignores mode bits, so ask
    the filesystem: a read-only mount refuses even root)."""
    probe = os.path.join(directory, f".probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return True
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True
