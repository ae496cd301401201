"""Exception classes shared by the three packages.

Each one subclasses the stdlib exception a caller would already catch for that kind of
problem, so ``except ValueError`` keeps working around code that moves to precompile.
"""

from __future__ import annotations


class PrecompileError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidOptionError(PrecompileError, ValueError):
    """An argument (hints, sizes, format, path...) is not what the API accepts."""


class InputMismatchError(PrecompileError, ValueError):
    """A call's inputs break the graph's contract (count, rank, dtype, device, static dims)."""


class NoVariantError(PrecompileError, ValueError):
    """No compiled variant's guards admit the call's sizes; nothing is compiled instead."""


class CorruptArtifactError(PrecompileError, ValueError):
    """An artifact is truncated, altered, foreign, or fails its checksum."""


class IncompatibleArtifactError(PrecompileError, RuntimeError):
    """An artifact was built by another torch build (or for another device) than this one."""


class UnsupportedGraphError(PrecompileError, NotImplementedError):
    """The graph uses something this library cannot compile into checked variants yet."""


class UnsafeCacheError(PrecompileError, PermissionError):
    """A cache entry is owned by another user or writable by others; loading it would run
    code that someone else could have written."""


class CacheWriteError(PrecompileError, OSError):
    """The cache could not store an entry (a full or read-only disk, say); nothing partial
    was left behind, and what was being stored is still returned to the caller."""


class ArtifactNotFoundError(PrecompileError, FileNotFoundError):
    """No artifact under that tag or key (or, offline, no cache entry to serve a compile)."""


class ArtifactAccessError(PrecompileError, PermissionError):
    """An artifact (or a file or directory of one) exists but this user may not read it."""


class UntrustedArtifactError(PrecompileError, PermissionError):
    """Trusted keys are configured and the artifact is unsigned, signed by another key,
    or its signature does not match; nothing of it was unpickled or imported."""


__all__ = [
    "ArtifactAccessError",
    "ArtifactNotFoundError",
    "CacheWriteError",
    "CorruptArtifactError",
    "IncompatibleArtifactError",
    "InputMismatchError",
    "InvalidOptionError",
    "NoVariantError",
    "PrecompileError",
    "UnsafeCacheError",
    "UnsupportedGraphError",
    "UntrustedArtifactError",
]
