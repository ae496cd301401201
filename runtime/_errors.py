"""Exception classes of the runtime; the storage errors it raises too (defined in
``precompile.cache._errors``, re-exported here: one class object each, wherever it is
imported from).

Each one subclasses the stdlib exception a caller would already catch for that kind of
problem, so ``except ValueError`` keeps working around code that moves to precompile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
    """A call's inputs break the graph's contract (count, rank, dtype, device, static dims).

    ``input_name``: the input refused, as the message says it: a compiled model's
    argument (``x``, ``past_key_values.layers[0].keys``), else the graph input's name, or
    ``input 3`` where the graph has none. ``expected`` and ``got``: what the contract
    wants and what the call passed for it (a dtype's or device's name, a shape, a value).
    Each is None where the refusal is not about one input (a wrong count of inputs, a
    model in the other train/eval mode, a hook, aliased written inputs, a call nested
    otherwise) or has no single wanted value (strides that cannot be copied into).
    """

    def __init__(
        self,
        *args: object,
        input_name: str | None = None,
        expected: Any = None,
        got: Any = None,
    ) -> None:
        super().__init__(*args)
        self.input_name = input_name
        self.expected = expected
        self.got = got

    def restated(self, message: str, input_name: str | None = None) -> InputMismatchError:
        """The same refusal (class and facts) said in a caller's terms: a compiled model
        names its arguments where the artifact named graph inputs."""
        return type(self)(
            message,
            input_name=self.input_name if input_name is None else input_name,
            expected=self.expected,
            got=self.got,
        )


class IndexOutOfRangeError(InputMismatchError, IndexError):
    """An input used as indices into a table (an embedding's rows) holds a value outside
    it: refused before any compiled kernel reads it, as eager raises IndexError.

    ``expected``: the table's rows as ``range(0, rows)`` where the check knows them;
    ``got``: the value outside. A compiled kernel's own bounds check (a CUDA input) says
    neither, and names the input in its message alone: all three are None then.
    """


class NoVariantError(PrecompileError, ValueError):
    """No compiled variant's guards admit the call's sizes; nothing is compiled instead.

    ``sizes``: the call's dynamic sizes by symbol (``{"s0": 5}``). ``candidates``: how
    each variant fared for them (:class:`precompile.Candidate` rows, with the guards
    that failed). A compiled model that has no trace of a length of 1 refuses before any
    variant is asked: its ``sizes`` name the lengths (``{"input_ids dim 1": 1}``) and its
    ``candidates`` are empty.
    """

    def __init__(
        self,
        *args: object,
        sizes: Mapping[str, int] | None = None,
        candidates: Sequence[Any] | None = None,
    ) -> None:
        super().__init__(*args)
        self.sizes: dict[str, int] | None = None if sizes is None else dict(sizes)
        self.candidates: tuple[Any, ...] | None = None if candidates is None else tuple(candidates)


class IncompatibleArtifactError(PrecompileError, RuntimeError):
    """An artifact was built by another torch build (or for another device) than this one."""


class UnsupportedGraphError(PrecompileError, NotImplementedError):
    """The graph uses something this library cannot compile into checked variants yet.

    ``specialized``: where the refusal is a dim asked to be dynamic that the trace fixed
    (the model's code reads it as a constant), that ``(argument, dim)``; else None.
    """

    def __init__(self, *args: object, specialized: tuple[str, int] | None = None) -> None:
        super().__init__(*args)
        self.specialized = specialized


class ArtifactNotFoundError(PrecompileError, FileNotFoundError):
    """No artifact under that tag or key (or, offline, no cache entry to serve a compile).

    ``key``: the cache key or the tag that was looked up and named nothing.
    """

    def __init__(self, *args: object, key: str | None = None) -> None:
        super().__init__(*args)
        self.key = key


__all__ = [
    "ArtifactAccessError",
    "ArtifactNotFoundError",
    "CacheRootError",
    "CacheWriteError",
    "CorruptArtifactError",
    "PayloadLimitError",
    "IncompatibleArtifactError",
    "IndexOutOfRangeError",
    "InputMismatchError",
    "InvalidOptionError",
    "NoVariantError",
    "PrecompileError",
    "UnsafeCacheError",
    "UnsupportedGraphError",
    "UntrustedArtifactError",
]
