"""Choosing a variant for a call's sizes: exact, nearest hint point, or as measured.

An exact-size variant wins, then the nearest admissible hint point. A calibration table
(measured on this device) overrules that choice where it covers the sizes and its
winner beat the choice by more than the table's ``min_gain``; an exact-size variant is
not overruled by measurements taken at other sizes. Nearness is the L1
distance in log2 space, the measure upstream's size-hint multi-kernel
uses (log2 of 0 taken as -1), restricted to the variants whose guards admit the sizes.
Ties go to the larger point: kernels tuned for more rows read the weights once where
kernels tuned for fewer re-read them per row block, and small sizes are memory-bound.
Remaining ties go to the variant listed first, so a choice never depends on dict order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from ._errors import NoVariantError
from ._expressions import compile_function
from ._manifest import Calibration, CalibrationEntry, Manifest

DecidedBy = Literal["calibrated", "exact-size", "nearest-hint", "only-variant", "no-variant"]


def log2_coordinate(value: int) -> float:
    return math.log2(value) if value > 0 else -1.0


def log2_distance(sizes: Sequence[int], point: Sequence[int]) -> float:
    return sum(
        abs(log2_coordinate(v) - log2_coordinate(h)) for v, h in zip(sizes, point, strict=True)
    )


def nearness(sizes: Sequence[int], point: Sequence[int]) -> tuple[float, float]:
    """Sort key of a point for ``sizes``: nearest in log2 space, then the larger point."""
    return log2_distance(sizes, point), -sum(map(log2_coordinate, point))


def lookup(
    calibration: Calibration, sizes: Sequence[int], admissible: Callable[[int], bool]
) -> CalibrationEntry | None:
    """The sample entry that decides for ``sizes``, or None where the table is silent."""
    if not calibration.entries:
        return None
    for axis, value in enumerate(sizes):
        coordinates = [e.point[axis] for e in calibration.entries]
        if not min(coordinates) <= value <= max(coordinates):
            return None
    nearest = min(
        enumerate(calibration.entries),
        key=lambda item: (*nearness(sizes, item[1].point), item[0]),
    )[1]
    return nearest if any(admissible(v) for v in nearest.ranking) else None


@dataclass(frozen=True)
class Candidate:
    """How one variant fared for the explained sizes."""

    variant: int
    kind: str
    point: Mapping[str, int]
    distance: float
    failed_guards: tuple[str, ...]

    @property
    def admissible(self) -> bool:
        return not self.failed_guards


@dataclass(frozen=True)
class Explanation:
    """Why a call would run the variant it runs (``art.explain(*args)``)."""

    sizes: Mapping[str, int]
    chosen: int | None
    decided_by: DecidedBy
    candidates: tuple[Candidate, ...]

    def __str__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items()) or "(no dynamic dims)"
        head = (
            f"sizes {sizes}: variant {self.chosen} ({self.decided_by})"
            if self.chosen is not None
            else f"sizes {sizes}: no variant admits these sizes"
        )
        rows = [head]
        for c in self.candidates:
            mark = "*" if c.variant == self.chosen else " "
            point = ", ".join(f"{k}={v}" for k, v in c.point.items())
            status = "ok" if c.admissible else "guards fail: " + "; ".join(c.failed_guards)
            rows.append(
                f" {mark} variant {c.variant} [{c.kind} {point}] "
                f"distance {c.distance:.3f}  {status}"
            )
        return "\n".join(rows)


class Dispatcher:
    """Pure decision logic over a manifest; memoization lives with the caller."""

    def __init__(self, manifest: Manifest, calibration: Calibration | None = None) -> None:
        self._calibration = calibration
        self._names = manifest.symbol_names
        self._variants = manifest.variants
        self._points = [tuple(v.point[n] for n in self._names) for v in self._variants]
        self._guards: list[Callable[..., tuple[Any, ...]] | None] = [
            compile_function(v.guards, self._names, name=f"variant_{v.index}_guards")
            if v.guards
            else None
            for v in self._variants
        ]
        self._bounds = [(s.name, s.min, s.max) for s in manifest.symbols]

    def admits(self, index: int, sizes: Sequence[int]) -> bool:
        """Whether variant ``index``'s ranges and guards allow ``sizes``."""
        return not self._failed_guards(index, sizes)

    def _failed_guards(self, index: int, sizes: Sequence[int]) -> tuple[str, ...]:
        failed = [
            f"{name} >= {low}" if value < low else f"{name} <= {high}"
            for (name, low, high), value in zip(self._bounds, sizes, strict=True)
            if value < low or (high is not None and value > high)
        ]
        guards = self._guards[index]
        if guards is None:
            return tuple(failed)
        try:
            results = guards(*sizes)
        except (ArithmeticError, ValueError, TypeError):
            return (*failed, "(guard evaluation raised)")
        texts = self._variants[index].guards
        return (*failed, *(text for text, ok in zip(texts, results, strict=True) if not ok))

    def explain(self, sizes: Sequence[int]) -> Explanation:
        candidates = tuple(
            Candidate(
                variant=v.index,
                kind=v.kind,
                point=v.point,
                distance=log2_distance(sizes, self._points[v.index]),
                failed_guards=self._failed_guards(v.index, sizes),
            )
            for v in self._variants
        )
        exact = [
            c
            for c in candidates
            if c.kind == "static" and c.admissible and self._points[c.variant] == tuple(sizes)
        ]
        admissible = [c for c in candidates if c.kind == "hint" and c.admissible]
        chosen: int | None
        decided_by: DecidedBy
        if exact:
            chosen, decided_by = exact[0].variant, "exact-size"
        elif admissible:
            best = min(
                admissible, key=lambda c: (*nearness(sizes, self._points[c.variant]), c.variant)
            )
            chosen = best.variant
            decided_by = "only-variant" if len(admissible) == 1 else "nearest-hint"
        else:
            chosen, decided_by = None, "no-variant"
        measured = self._measured_choice(sizes, candidates, exact_exists=bool(exact))
        if measured is not None and self._overrules(measured, chosen):
            chosen, decided_by = measured[1], "calibrated"
        named = MappingProxyType(dict(zip(self._names, sizes, strict=True)))
        return Explanation(named, chosen, decided_by, candidates)

    def _measured_choice(
        self, sizes: Sequence[int], candidates: Sequence[Candidate], exact_exists: bool
    ) -> tuple[CalibrationEntry, int] | None:
        """The deciding table entry and its fastest admissible variant, if the table covers
        ``sizes``."""
        if self._calibration is None:
            return None
        ok = {c.variant for c in candidates if c.admissible}
        entry = lookup(self._calibration, sizes, ok.__contains__)
        if entry is None or (exact_exists and entry.point != tuple(sizes)):
            return None
        return entry, next(v for v in entry.ranking if v in ok)

    def _overrules(self, measured: tuple[CalibrationEntry, int], heuristic: int | None) -> bool:
        """A measured winner replaces the compile-time choice if that choice was not
        measured at the sample, or was slower there by more than the table's ``min_gain``:
        a gap inside the timer's noise is no reason to switch. (A winner that agrees with
        the choice confirms it.)"""
        entry, fastest = measured
        if heuristic is None or heuristic not in entry.times or fastest == heuristic:
            return True
        assert self._calibration is not None
        return entry.times[heuristic] > entry.times[fastest] * (1.0 + self._calibration.min_gain)

    def choose(self, sizes: Sequence[int]) -> int:
        explanation = self.explain(sizes)
        if explanation.chosen is None:
            raise NoVariantError(
                "no compiled variant admits these sizes, and precompile never compiles at "
                "call time; compile with a hint or exact size that covers them.\n"
                + str(explanation),
                sizes=explanation.sizes,
                # points as dicts: a mappingproxy does not pickle, and errors cross processes
                candidates=[replace(c, point=dict(c.point)) for c in explanation.candidates],
            )
        return explanation.chosen
