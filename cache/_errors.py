"""The storage layer's exception classes, and the base class of every error the three
packages raise (the runtime and the compile side re-export and subclass these).

Each one subclasses the stdlib exception a caller would already catch for that kind of
problem, so ``except ValueError`` keeps working around code that moves to precompile.
"""

from __future__ import annotations


class PrecompileError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidOptionError(PrecompileError, ValueError):
    """An argument (hints, sizes, format, path...) is not what the API accepts."""


class CacheRootError(InvalidOptionError, NotADirectoryError):
    """The cache root cannot hold a cache: it is a file (or another thing that is not a
    directory), or the cache's layout cannot be made in it."""


class CorruptArtifactError(PrecompileError, ValueError):
    """An artifact is truncated, altered, foreign, or fails its checksum."""


class PayloadLimitError(CorruptArtifactError):
    """A payload is larger than ``$PRECOMPILE_MAX_PAYLOAD_BYTES`` allows: a lying index, or
    a healthy artifact under a limit set too low. Refused, but never treated as damage (a
    cache entry is not quarantined for it)."""


class UnsafeCacheError(PrecompileError, PermissionError):
    """A cache entry is owned by another user or writable by others; loading it would run
    code that someone else could have written."""


class CacheWriteError(PrecompileError, OSError):
    """The cache could not store an entry (a full or read-only disk, say); nothing partial
    was left behind, and what was being stored is still returned to the caller."""


class ArtifactAccessError(PrecompileError, PermissionError):
    """An artifact (or a file or directory of one) exists but this user may not read it."""


class UntrustedArtifactError(PrecompileError, PermissionError):
    """Trusted keys are configured and the artifact is unsigned, signed by another key,
    or its signature does not match; nothing of it was unpickled or imported."""


__all__ = [
    "ArtifactAccessError",
    "CacheWriteError",
    "CorruptArtifactError",
    "InvalidOptionError",
    "PrecompileError",
    "UnsafeCacheError",
    "UntrustedArtifactError",
]
