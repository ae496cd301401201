"""Reading a manifest back: every field validated, so a damaged or foreign manifest is
reported as such instead of failing later in a confusing place."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ._errors import CorruptArtifactError
from ._expressions import SYMBOL_NAME, check_expression
from ._manifest import (
    FORMAT_NAME,
    READABLE_VERSIONS,
    Calibration,
    CalibrationEntry,
    Environment,
    InputSpec,
    IntInput,
    Manifest,
    NativeKernel,
    Symbol,
    SymbolSource,
    TensorInput,
    Variant,
)


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    numeric = kind is int or (isinstance(kind, tuple) and int in kind)
    if not isinstance(value, kind) or (numeric and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise CorruptArtifactError(f"manifest field {where} should be {names}, got {value!r}")
    return value


def _digest(value: Any, where: str) -> str:
    text = _expect(value, str, where)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise CorruptArtifactError(f"manifest field {where} is not a sha256 hex digest")
    return str(text)


def _size_entry(value: Any, names: Sequence[str], where: str) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = _expect(value, str, where)
    check_expression(text, names)
    return str(text)


def _kernels(value: Any, where: str) -> tuple[NativeKernel, ...]:
    kernels = []
    for n, entry in enumerate(_expect(value, list, where)):
        at = f"{where}[{n}]"
        _expect(entry, dict, at)
        features = _expect(entry.get("cpu_features"), list, f"{at}.cpu_features")
        kernels.append(
            NativeKernel(
                key=_digest(entry.get("key"), f"{at}.key"),
                binary=_digest(entry.get("binary"), f"{at}.binary"),
                isa=str(_expect(entry.get("isa"), str, f"{at}.isa")),
                cpu_features=tuple(str(_expect(f, str, f"{at}.cpu_features")) for f in features),
                machine=str(_expect(entry.get("machine"), str, f"{at}.machine")),
            )
        )
    return tuple(kernels)


def parse_manifest(raw: bytes) -> Manifest:
    """Validate and decode manifest bytes; any defect is a CorruptArtifactError."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptArtifactError(f"manifest is not valid JSON: {exc}") from None
    return manifest_from_json(data)


def manifest_from_json(data: Any) -> Manifest:
    """Validate an already-decoded manifest document (as ``Manifest.to_json`` wrote it)."""
    _expect(data, dict, "<root>")
    if data.get("format") != FORMAT_NAME:
        raise CorruptArtifactError(f"not a precompile artifact (format={data.get('format')!r})")
    version = _expect(data.get("format_version"), int, "format_version")
    if version not in READABLE_VERSIONS:
        raise CorruptArtifactError(
            f"artifact format version {version} is not supported (this precompile reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    env_raw = _expect(data.get("environment"), dict, "environment")
    try:
        environment = Environment(**env_raw)
    except TypeError as exc:
        raise CorruptArtifactError(f"manifest field environment is malformed: {exc}") from None

    inputs_raw = _expect(data.get("inputs"), list, "inputs")
    symbols: list[Symbol] = []
    for n, entry in enumerate(_expect(data.get("symbols"), list, "symbols")):
        _expect(entry, dict, f"symbols[{n}]")
        name = _expect(entry.get("name"), str, f"symbols[{n}].name")
        if not SYMBOL_NAME.match(name):
            raise CorruptArtifactError(f"symbol name {name!r} is not an identifier")
        sources = []
        for m, pair in enumerate(_expect(entry.get("sources"), list, f"symbols[{n}].sources")):
            where = f"symbols[{n}].sources[{m}]"
            if not (isinstance(pair, list) and len(pair) == 2):
                raise CorruptArtifactError(f"manifest field {where} should be [index, dim]")
            index = _expect(pair[0], int, where)
            dim = None if pair[1] is None else _expect(pair[1], int, where)
            if not 0 <= index < len(inputs_raw):
                raise CorruptArtifactError(f"manifest field {where} names a missing input")
            sources.append(SymbolSource(index, dim))
        if not sources:
            raise CorruptArtifactError(f"symbol {name} has no source in the inputs")
        low = _expect(entry.get("min", 0), int, f"symbols[{n}].min")
        high = entry.get("max")
        high = None if high is None else _expect(high, int, f"symbols[{n}].max")
        symbols.append(Symbol(name, tuple(sources), low, high))
    names = [s.name for s in symbols]

    inputs: list[InputSpec] = []
    for n, entry in enumerate(inputs_raw):
        _expect(entry, dict, f"inputs[{n}]")
        if entry.get("kind") == "tensor":
            shape = tuple(
                _size_entry(v, names, f"inputs[{n}].shape[{d}]")
                for d, v in enumerate(_expect(entry.get("shape"), list, f"inputs[{n}].shape"))
            )
            inputs.append(
                TensorInput(
                    _expect(entry.get("dtype"), str, f"inputs[{n}].dtype"),
                    _expect(entry.get("device"), str, f"inputs[{n}].device"),
                    shape,
                )
            )
        elif entry.get("kind") == "int":
            inputs.append(IntInput(_size_entry(entry.get("value"), names, f"inputs[{n}].value")))
        else:
            raise CorruptArtifactError(f"manifest field inputs[{n}].kind is unknown")

    variants: list[Variant] = []
    for n, entry in enumerate(_expect(data.get("variants"), list, "variants")):
        _expect(entry, dict, f"variants[{n}]")
        kind = entry.get("kind")
        if kind not in ("hint", "static"):
            raise CorruptArtifactError(f"manifest field variants[{n}].kind is unknown")
        point = _expect(entry.get("point"), dict, f"variants[{n}].point")
        if sorted(point) != sorted(names):
            raise CorruptArtifactError(f"variants[{n}].point does not name every symbol")
        for key, value in point.items():
            _expect(value, int, f"variants[{n}].point[{key}]")
        guards = tuple(
            str(_expect(g, str, f"variants[{n}].guards"))
            for g in _expect(entry.get("guards"), list, f"variants[{n}].guards")
        )
        for guard in guards:
            check_expression(guard, names)
        variants.append(
            Variant(
                index=n,
                kind=kind,
                point={name: point[name] for name in names},
                guards=guards,
                payload=_digest(entry.get("payload"), f"variants[{n}].payload"),
                code=_digest(entry.get("code"), f"variants[{n}].code"),
                kernels=_kernels(entry.get("kernels", []), f"variants[{n}].kernels"),
            )
        )
    if not variants:
        raise CorruptArtifactError("manifest lists no variants")
    extra = _expect(data.get("extra", {}), dict, "extra")
    calibration = _calibration(data.get("calibration"), len(names), len(variants))
    return Manifest(environment, tuple(symbols), tuple(inputs), tuple(variants), extra, calibration)


def _calibration(value: Any, symbols: int, variants: int) -> Calibration | None:
    if value is None:
        return None
    _expect(value, dict, "calibration")
    entries = []
    for n, entry in enumerate(_expect(value.get("entries"), list, "calibration.entries")):
        where = f"calibration.entries[{n}]"
        _expect(entry, dict, where)
        point = tuple(
            _expect(v, int, f"{where}.point")
            for v in _expect(entry.get("point"), list, f"{where}.point")
        )
        if len(point) != symbols:
            raise CorruptArtifactError(f"manifest field {where}.point does not size every symbol")
        times: dict[int, float] = {}
        for key, seconds in _expect(entry.get("times"), dict, f"{where}.times").items():
            if not (key.isdigit() and int(key) < variants):
                raise CorruptArtifactError(
                    f"manifest field {where}.times names no variant ({key!r})"
                )
            times[int(key)] = float(_expect(seconds, (int, float), f"{where}.times[{key}]"))
        if not times:
            raise CorruptArtifactError(f"manifest field {where}.times is empty")
        entries.append(CalibrationEntry(point, times))
    min_gain = float(_expect(value.get("min_gain", 0.0), (int, float), "calibration.min_gain"))
    if not min_gain >= 0:
        raise CorruptArtifactError(f"manifest field calibration.min_gain is {min_gain}, not >= 0")
    return Calibration(
        device_name=str(_expect(value.get("device_name"), str, "calibration.device_name")),
        method=str(_expect(value.get("method"), str, "calibration.method")),
        entries=tuple(entries),
        min_gain=min_gain,
    )
