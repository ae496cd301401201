"""Declared size ranges of dynamic dims: what a caller promises its calls will be.

``compile_model(dynamic={"input_ids": {1: (2, 4096)}})`` says the dim takes sizes 2 to
4096 only. A least size of 2 or more drops the trace at length 1 (Dynamo traces 1 apart,
so each dynamic length costs a trace and a compile of its own there); a most size bounds
the variants. A range only ever refuses more: it becomes guards of the compiled graphs
(``s >= 2``, ``s <= 4096``), checked at every call as the trace's own are, and a call
outside it is refused naming the argument, the dim and the range. Nothing is told to
Dynamo, whose trace at sizes of 2 and more already holds wherever these guards do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from precompile.runtime import InvalidOptionError

# what a dim's range is read from: (least, most), most None for no bound; None for the
# default; or a ``torch.export.Dim`` (its ``min`` and ``max``)
RangeSpec = tuple[int, int | None] | Any


@dataclass(frozen=True)
class SizeRange:
    """The sizes one dynamic dim takes: ``least`` to ``most`` (None: no bound)."""

    least: int = 1
    most: int | None = None

    @property
    def default(self) -> bool:
        return self.least == 1 and self.most is None

    def holds(self, size: int) -> bool:
        return self.least <= size and (self.most is None or size <= self.most)

    def guards(self, symbol: str) -> list[str]:
        """The guards a graph whose ``symbol`` is this dim's size gets. A least of 2 is
        guarded too: the graph traced at 2 and more is then the only one for the dim, and
        it may not serve 1 (Dynamo's 0/1 specialization)."""
        found = [f"{symbol} >= {self.least}"] if self.least >= 2 else []
        if self.most is not None:
            found.append(f"{symbol} <= {self.most}")
        return found

    def intersect(self, other: SizeRange) -> SizeRange:
        highs = [h for h in (self.most, other.most) if h is not None]
        return SizeRange(max(self.least, other.least), min(highs) if highs else None)

    def __str__(self) -> str:
        return f"[{self.least}, {'no bound' if self.most is None else self.most}]"


def _bound(value: Any) -> int | None:
    """A ``torch.export.Dim`` bound as an int; its unbounded max (``int_oo``, a sympy
    number, not an int) as None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return None if value >= 1 << 62 else value


def _is_export_dim(value: Any) -> bool:
    """A ``torch.export.Dim``: an instance of the class (torch 2.13), or the class a call
    of ``Dim`` made (earlier torch, whose ``Dim`` is a function). Not any object with a
    ``min`` and a ``max`` (a NumPy array has both, as methods)."""
    import torch.export

    dim = torch.export.Dim
    if isinstance(dim, type) and isinstance(value, dim):
        return True
    return (
        isinstance(value, type)
        and type(value).__name__ == "_Dim"
        and isinstance(getattr(value, "min", None), int)
    )


def parse_range(value: Any, where: str) -> SizeRange:
    """``value`` (a ``dynamic=`` mapping's entry for ``where``) as a range, checked."""
    if value is None:
        return SizeRange()
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise InvalidOptionError(
                f"dynamic {where}: a range is (least, most), most None for no bound; got {value!r}"
            )
        least, most = value
    elif _is_export_dim(value):
        least, most = max(_bound(value.min) or 1, 1), _bound(value.max)
    else:
        raise InvalidOptionError(
            f"dynamic {where}: a range is (least, most), a torch.export.Dim or None; got {value!r}"
        )
    for bound, name in ((least, "least"), (most, "most")):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, Integral)):
            raise InvalidOptionError(
                f"dynamic {where}: the {name} size must be an int, got {bound!r}"
            )
    least = 1 if least is None else int(least)
    most = None if most is None else int(most)
    if least < 1:
        raise InvalidOptionError(
            f"dynamic {where}: the least size must be at least 1 (a call of size 0 is "
            f"refused), got {least}"
        )
    if most is not None and most < max(least + 1, 2):
        raise InvalidOptionError(
            f"dynamic {where}: the most size {most} leaves no dynamic range above the least "
            f"{least} (a dynamic dim takes two sizes or more; one size is a static dim)"
        )
    return SizeRange(least, most)


def check_within(
    ranges: Mapping[tuple[int, int], SizeRange],
    names: Mapping[tuple[int, int], str],
    example: Mapping[tuple[int, int], int],
    hints: Any,
    sizes: Any,
    key_of: Mapping[tuple[int, int], Any],
) -> None:
    """The example's sizes, and every hint and exact size meant for a dim with a declared
    range, lie in that range: a variant outside it could never be called. ``names``
    says each dim as the caller does; ``key_of`` is its ``(argument, dim)`` key."""
    for place, size_range in ranges.items():
        size = example.get(place)
        if size is not None and not size_range.holds(size):
            raise InvalidOptionError(
                f"{names[place]} is {size} in the example call, outside its declared range "
                f"{size_range}"
            )
        per_dim = isinstance(hints, Mapping)
        wanted = hints.get(key_of[place], ()) if per_dim else hints
        for value in _ints(wanted):
            if not size_range.holds(value):
                raise InvalidOptionError(
                    f"hint {value} for {names[place]} is outside its declared range "
                    f"{size_range}: a variant there could never be called"
                    + ("" if per_dim else " (a list of hints applies to every dynamic dim: "
                       "give hints per dim, keyed (argument, dim))")
                )  # fmt: skip
        for entry in _entries(sizes):
            exact = entry.get(key_of[place]) if isinstance(entry, Mapping) else entry
            for value in _ints([exact]):
                if not size_range.holds(value):
                    raise InvalidOptionError(
                        f"size {value} for {names[place]} is outside its declared range "
                        f"{size_range}: a variant there could never be called"
                    )


def _ints(values: Any) -> list[int]:
    """The ints of a hints entry (malformed ones are ``plan_variants``' to refuse)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        return []
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _entries(sizes: Any) -> list[Any]:
    if isinstance(sizes, (str, bytes, Mapping)) or not isinstance(sizes, Sequence):
        return []
    return list(sizes)
