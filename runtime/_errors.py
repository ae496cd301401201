"""Exception classes of the runtime; the storage errors it raises too (defined in
``precompile.cache._errors``, re-exported here: one class object each, wherever it is
imported from).

Each one subclasses the stdlib exception a caller would already catch for that kind of
problem, so ``except ValueError`` keeps working around code that moves to precompile.
"""

from __future__ import annotations

from precompile.cache import (
    ArtifactAccessError,
    CacheRootError,
    CacheWriteError,
    CorruptArtifactError,
    InvalidOptionError,
    PayloadLimitError,
    PrecompileError,
    UnsafeCacheError,
    UntrustedArtifactError,
)


class InputMismatchError(PrecompileError, ValueError):
    """A call's inputs break the graph's contract (count, rank, dtype, device, static dims)."""


class IndexOutOfRangeError(InputMismatchError, IndexError):
    """An input used as indices into a table (an embedding's rows) holds a value outside
    it: refused before any compiled kernel reads it, as eager raises IndexError."""


class NoVariantError(PrecompileError, ValueError):
    """No compiled variant's guards admit the call's sizes; nothing is compiled instead."""


class IncompatibleArtifactError(PrecompileError, RuntimeError):
    """An artifact was built by another torch build (or for another device) than this one."""


class UnsupportedGraphError(PrecompileError, NotImplementedError):
    """The graph uses something this library cannot compile into checked variants yet."""


class ArtifactNotFoundError(PrecompileError, FileNotFoundError):
    """No artifact under that tag or key (or, offline, no cache entry to serve a compile)."""


__all__ = [
    "ArtifactAccessError",
    "ArtifactNotFoundError",
    "CacheRootError",
    "CacheWriteError",
    "CorruptArtifactError",
    "PayloadLimitError",
    "IncompatibleArtifactError",
    "InputMismatchError",
    "InvalidOptionError",
    "NoVariantError",
    "PrecompileError",
    "UnsafeCacheError",
    "UnsupportedGraphError",
    "UntrustedArtifactError",
]
