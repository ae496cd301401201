"""Every error precompile raises on purpose, in one place, grouped by what went wrong.

Each class is defined in the lowest layer that raises it (the cache's storage errors in
``precompile.cache``, the runtime's call and artifact errors in ``precompile.runtime``)
and is the same class object here: ``except precompile.errors.NoVariantError`` catches
what ``precompile.runtime`` raises. All subclass :class:`PrecompileError` and the stdlib
exception a caller would already catch (``InputMismatchError`` is a ``ValueError``).

The facts a handler needs are attributes, None where the raising code did not know them,
and survive pickling (errors cross processes): ``NoVariantError.sizes`` and
``.candidates``, ``InputMismatchError.input_name``, ``.expected`` and ``.got``,
``ArtifactNotFoundError.key``, ``CorruptArtifactError.path``.
"""

from __future__ import annotations

from precompile.runtime import (
    ArtifactAccessError,
    ArtifactNotFoundError,
    CacheRootError,
    CacheWriteError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    IndexOutOfRangeError,
    InputMismatchError,
    InvalidOptionError,
    NoVariantError,
    PayloadLimitError,
    PrecompileError,
    UnsafeCacheError,
    UnsupportedGraphError,
    UntrustedArtifactError,
)

__all__ = [
    # The base of them all
    "PrecompileError",
    # Arguments and options the API does not accept
    "InvalidOptionError",
    "CacheRootError",
    # Compiling: a graph this library cannot turn into checked variants
    "UnsupportedGraphError",
    # Calling: inputs that break the compiled contract, sizes no variant serves
    "InputMismatchError",
    "IndexOutOfRangeError",
    "NoVariantError",
    # Finding and reading artifacts
    "ArtifactNotFoundError",
    "CorruptArtifactError",
    "PayloadLimitError",
    "IncompatibleArtifactError",
    # Trust and permissions: files of another user, unsigned or foreign artifacts
    "ArtifactAccessError",
    "UnsafeCacheError",
    "UntrustedArtifactError",
    # Storing
    "CacheWriteError",
]
