"""Where the cache lives and how its directory tree is laid out (versioned)."""

from __future__ import annotations

import os

import platformdirs

LAYOUT = "v1"
_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by precompile.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


def resolve_root(root: str | os.PathLike[str] | None) -> str:
    """``root`` argument, else ``$PRECOMPILE_CACHE_DIR``, else the user cache dir."""
    if root is not None:
        return os.path.abspath(os.fspath(root))
    configured = os.environ.get("PRECOMPILE_CACHE_DIR")
    if configured:
        return os.path.abspath(configured)
    return os.path.abspath(platformdirs.user_cache_dir("precompile"))


def private_dir(path: str) -> str:
    """Create ``path`` (and parents) readable by this user only."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def prepare(root: str) -> dict[str, str]:
    """Create the layout if missing; return its directories by role."""
    private_dir(root)
    tag = os.path.join(root, "CACHEDIR.TAG")
    if not os.path.exists(tag):
        with open(tag, "w", encoding="utf-8") as handle:
            handle.write(_TAG)
    base = os.path.join(root, LAYOUT)
    dirs = {
        "base": base,
        "entries": os.path.join(base, "entries"),
        "blobs": os.path.join(base, "blobs"),
        "locks": os.path.join(base, "locks"),
        "quarantine": os.path.join(base, "quarantine"),
        "tags": os.path.join(base, "tags"),
    }
    for path in dirs.values():
        private_dir(path)
    return dirs
