"""Lazy package attributes (PEP 562), so importing a package costs only what it uses."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_getattr(
    package: str,
    table: Mapping[str, str],
    namespace: MutableMapping[str, Any],
    *,
    anchor: str | None = None,
) -> Callable[[str], Any]:
    """A module ``__getattr__`` importing ``table[name]`` (a module path, relative to
    ``anchor``, by default ``package``, if it starts with '.'; ``module:attribute`` where
    the module calls it otherwise) on first use and keeping the value in ``namespace``
    (the module's globals), so later lookups cost nothing."""

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(":")
        value = getattr(importlib.import_module(module, anchor or package), attribute or name)
        namespace[name] = value
        return value

    return __getattr__
