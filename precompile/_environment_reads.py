"""The environment variables a model's forward reads, recorded by running it.

Dynamo guards a variable the trace found set (``os.environ._data[b'FLAG']`` equal to its
value), but a lookup of a variable that was *unset* leaves no guard it hands a backend's
guard filter: a forward that branches on ``os.environ.get("FLAG")`` compiled with FLAG
unset kept serving that branch once FLAG was set (found by a client trial; transformers'
SDPA attention reads ``TRANSFORMERS_SDPA_FORCE_GQA`` this way). Where the trace read the
environment at all, the forward runs once more, eagerly, with ``os.environ`` answering
through a recording view of the same variables: every name looked up (found or not)
becomes a check of its own, evaluated per call and at bind like the guards Dynamo gave.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from precompile.runtime.compiler_interface import Guard
from precompile.runtime.compiler_interface import encode_guard_value as encode

# The expression of ``os.environ._data``, as the runtime's guards spell it.
_DATA = ["attr", ["attr", ["G", "__import_os"], "environ"], "_data"]


def reads_environment(guards: Sequence[Any]) -> bool:
    """Whether Dynamo's guards of a trace say it read ``os.environ`` (its sources)."""
    return any(".environ" in str(getattr(entry, "source", "")) for entry in guards)


class _Recording(os._Environ):  # type: ignore[type-arg,name-defined,misc]
    """``os.environ``'s variables (the same table), noting every name looked up."""

    def __init__(self, original: Any, names: set[str]) -> None:
        super().__init__(
            original._data, original.encodekey, original.decodekey, original.encodevalue,
            original.decodevalue,
        )  # fmt: skip
        self._names = names

    def __getitem__(self, key: Any) -> Any:
        self._names.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._names.add(key)
        return super().__contains__(key)


@contextmanager
def _recording() -> Iterator[set[str]]:
    names: set[str] = set()
    original = os.environ
    # what ``os.environ`` and ``os.getenv`` read for the duration (the same variables)
    os.environ = _Recording(original, names)  # noqa: B003
    try:
        yield names
    finally:
        os.environ = original  # noqa: B003


def environment_guards(run: Callable[[], Any]) -> list[Guard]:
    """A check per environment variable ``run`` (the forward, eagerly) looks up: its
    value where it is set, its absence where it is not."""
    with _recording() as names, torch.no_grad():
        run()
    guards = []
    for name in sorted(n for n in names if isinstance(n, str)):
        key = os.environ.encodekey(name)  # type: ignore[attr-defined]
        data = os.environ._data  # type: ignore[attr-defined]
        if key in data:
            expr = ["item", _DATA, ["const", encode(key)]]
            guards.append(Guard("equals", expr, encode(data[key])))
        else:
            guards.append(Guard("not_contains", _DATA, True, encode(key)))
    return guards
