"""The storage layer's exception classes, and the base class of every error the three
packages raise (the runtime and the compile side re-export and subclass these).

Each one subclasses the stdlib exception a caller would already catch for that kind of
problem, so ``except ValueError`` keeps working around code that moves to precompile.
All of them are importable from one public module, ``precompile.errors``.
"""

from __future__ import annotations

import os


class PrecompileError(Exception):
    """Base class of every error this library raises on purpose.

    The facts a handler needs ride on the error as attributes, set from keyword-only
    arguments (None where the raising code did not know them), so ``raise X("message")``
    stays valid. They survive pickling, which errors need to cross processes (the
    tensor-parallel and subprocess paths): ``BaseException`` pickles as
    ``(type(self), self.args, self.__dict__)``, and the attributes live in ``__dict__``.
    """


class InvalidOptionError(PrecompileError, ValueError):
    """An argument (hints, sizes, format, path...) is not what the API accepts."""


class CacheRootError(InvalidOptionError, NotADirectoryError):
    """The cache root cannot hold a cache: it is a file (or another thing that is not a
    directory), or the cache's layout cannot be made in it."""


class CorruptArtifactError(PrecompileError, ValueError):
    """An artifact is truncated, altered, foreign, or fails its checksum.

    ``path``: the file or directory that is damaged, where the raising code reads one;
    None where it checks bytes or a document already read (a payload, a manifest field, a
    remote object, whose message names it), which is most of the checks.
    """

    def __init__(self, *args: object, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(*args)
        self.path: str | None = None if path is None else os.fspath(path)


class PayloadLimitError(CorruptArtifactError):
    """A payload is larger than ``$PRECOMPILE_MAX_PAYLOAD_BYTES`` allows: a lying index, or
    a healthy artifact under a limit set too low. Refused, but never treated as damage (a
    cache entry is not quarantined for it)."""


class UnsafeCacheError(PrecompileError, PermissionError):
    """A cache entry is owned by another user or writable by others; loading it would run
    code that someone else could have written."""


class CacheWriteError(PrecompileError, OSError):
    """Bytes could not be written (a full or read-only disk, say): the cache could not
    store an entry, and what was being stored is still returned to the caller, or
    ``save`` could not write an artifact. Nothing partial is left behind."""


class ArtifactAccessError(PrecompileError, PermissionError):
    """An artifact (or a file or directory of one) exists but this user may not read it."""


class UntrustedArtifactError(PrecompileError, PermissionError):
    """Trusted keys are configured and the artifact is unsigned, signed by another key,
    or its signature does not match; nothing of it was unpickled or imported."""


__all__ = [
    "ArtifactAccessError",
    "CacheRootError",
    "CacheWriteError",
    "CorruptArtifactError",
    "InvalidOptionError",
    "PayloadLimitError",
    "PrecompileError",
    "UnsafeCacheError",
    "UntrustedArtifactError",
]
