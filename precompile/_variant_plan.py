"""Turning ``hints=`` and ``sizes=`` into the list of variants to compile.

All validation happens here, before any compile starts, so a typo costs milliseconds,
not minutes of compilation followed by an error.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from precompile.runtime import InvalidOptionError

log = logging.getLogger("precompile.compile")

DimKey = str | tuple[int, int]
Hints = Sequence[int] | Mapping[DimKey, Sequence[int]] | None
Sizes = Sequence[int | Mapping[DimKey, int]] | None
DEFAULT_MAX_VARIANTS = 32


@dataclass(frozen=True)
class VariantRequest:
    kind: Literal["hint", "static"]
    point: tuple[int, ...]  # one value per symbol, in symbol order


def _size(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise InvalidOptionError(f"{what} must be >= 0, got {value}")
    return value


def _symbol_for(
    key: Any, names: Sequence[str], dims: Mapping[tuple[int, int], str], what: str
) -> str:
    if isinstance(key, str):
        if key not in names:
            raise InvalidOptionError(
                f"{what} names symbol {key!r}, but the graph's symbols are {list(names)}"
            )
        return key
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key):
        if key not in dims:
            known = ", ".join(f"{k} -> {v}" for k, v in dims.items())
            raise InvalidOptionError(
                f"{what} names (input_index, dim) {key}, which is not a dynamic dim; "
                f"dynamic dims are: {known or 'none'}"
            )
        return dims[key]
    raise InvalidOptionError(
        f"{what} keys must be symbol names (str) or (input_index, dim) tuples, got {key!r}"
    )


def _by_symbol(
    mapping: Mapping[Any, Any], names: Sequence[str], dims: Mapping[tuple[int, int], str], what: str
) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for key, value in mapping.items():
        name = _symbol_for(key, names, dims, what)
        if name in resolved and resolved[name] != value:  # two dims Dynamo found equal
            raise InvalidOptionError(
                f"{what} gives symbol {name} twice, otherwise (as {key!r} too)"
            )
        resolved[name] = value
    return resolved


def _hint_points(
    hints: Hints, names: Sequence[str], dims: Mapping[tuple[int, int], str], default: Sequence[int]
) -> list[tuple[int, ...]]:
    if hints is None:
        return [tuple(default)]
    if isinstance(hints, Mapping):
        per_symbol = _by_symbol(hints, names, dims, "hints")
        axes: list[list[int]] = []
        for name, fallback in zip(names, default, strict=True):
            values = per_symbol.get(name, [fallback])
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise InvalidOptionError(
                    f"hints[{name!r}] must be a non-empty list of ints, got {values!r}"
                )
            axes.append([_size(v, f"hints[{name!r}] entry") for v in values])
        return [tuple(p) for p in itertools.product(*axes)]
    if isinstance(hints, (str, bytes)) or not isinstance(hints, Sequence) or not hints:
        raise InvalidOptionError(
            f"hints must be a non-empty list of ints or a dict of lists, got {hints!r}"
        )
    return [tuple([_size(h, "hints entry")] * len(names)) for h in hints]


def _static_points(
    sizes: Sizes, names: Sequence[str], dims: Mapping[tuple[int, int], str]
) -> list[tuple[int, ...]]:
    if sizes is None:
        return []
    if isinstance(sizes, (str, bytes, Mapping)) or not isinstance(sizes, Sequence):
        raise InvalidOptionError(
            f"sizes must be a list of ints or of dicts (one per static variant), got {sizes!r}"
        )
    points = []
    for entry in sizes:
        if isinstance(entry, Mapping):
            resolved = _by_symbol(entry, names, dims, "sizes entry")
            missing = [n for n in names if n not in resolved]
            if missing:
                raise InvalidOptionError(
                    f"sizes entry {dict(entry)!r} must give every symbol; missing {missing}"
                )
            points.append(tuple(_size(resolved[n], f"sizes[{n!r}]") for n in names))
        else:
            points.append(tuple([_size(entry, "sizes entry")] * len(names)))
    return points


def check_kinds(hints: Hints, sizes: Sizes) -> None:
    """The container types ``hints`` and ``sizes`` accept, for graphs that use neither."""
    if hints is not None and (
        isinstance(hints, (str, bytes)) or not isinstance(hints, (Sequence, Mapping))
    ):
        raise InvalidOptionError(
            f"hints must be a non-empty list of ints or a dict of lists, got {hints!r}"
        )
    if sizes is not None and (
        isinstance(sizes, (str, bytes, Mapping)) or not isinstance(sizes, Sequence)
    ):
        raise InvalidOptionError(
            f"sizes must be a list of ints or of dicts (one per static variant), got {sizes!r}"
        )


def plan_variants(
    names: Sequence[str],
    dims: Mapping[tuple[int, int], str],
    default_point: Sequence[int],
    *,
    hints: Hints,
    sizes: Sizes,
    max_variants: int = DEFAULT_MAX_VARIANTS,
) -> list[VariantRequest]:
    """The variants to compile, hint variants first, duplicates dropped, order kept."""
    if isinstance(max_variants, bool) or not isinstance(max_variants, int) or max_variants < 1:
        raise InvalidOptionError(f"max_variants must be a positive int, got {max_variants!r}")
    if not names:
        # A static graph (Dynamo hands a backend one at size 1, say) has one possible
        # variant; the hints and sizes meant for its dynamic siblings do not apply.
        check_kinds(hints, sizes)
        if hints is not None or sizes is not None:
            log.debug("graph has no dynamic dims: hints and sizes ignored, one variant")
        return [VariantRequest("hint", ())]
    requests = [VariantRequest("hint", p) for p in _hint_points(hints, names, dims, default_point)]
    requests += [VariantRequest("static", p) for p in _static_points(sizes, names, dims)]
    unique = list(dict.fromkeys(requests))
    if len(unique) > max_variants:
        raise InvalidOptionError(
            f"hints and sizes ask for {len(unique)} variants, more than max_variants="
            f"{max_variants}; pass fewer hints or raise max_variants"
        )
    return unique
