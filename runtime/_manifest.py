"""The manifest: what an artifact promises about its graph, symbols and variants.

It is plain JSON in both formats (readable in the unpacked one) and is validated field by
field on load, so a damaged or foreign manifest is reported as such instead of failing
later in a confusing place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ._errors import CorruptArtifactError
from ._expressions import SYMBOL_NAME, check_expression

FORMAT_NAME = "precompile-artifact"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 carried no built kernels
VariantKind = Literal["hint", "static"]


@dataclass(frozen=True)
class Environment:
    """The build and device an artifact was compiled for."""

    torch: str
    torch_git: str
    cuda: str | None
    triton: str | None
    python: str
    platform: str
    device_type: str
    device_name: str
    capability: str


@dataclass(frozen=True)
class SymbolSource:
    """Where a symbol's value is read: ``args[input_index]`` itself or its size at ``dim``."""

    input_index: int
    dim: int | None


@dataclass(frozen=True)
class Symbol:
    """A dynamic dimension of the graph, under the name the graph gave it."""

    name: str
    sources: tuple[SymbolSource, ...]
    min: int = 0
    max: int | None = None


@dataclass(frozen=True)
class TensorInput:
    dtype: str
    device: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class IntInput:
    value: int | str


InputSpec = TensorInput | IntInput


@dataclass(frozen=True)
class NativeKernel:
    """A built C++ kernel a variant's wrapper imports, shipped so no compiler runs at load."""

    key: str  # sha256 of the (argtypes, source) the wrapper passes to cpp_pybinding
    binary: str  # sha256 of the built .so (a payload of the artifact)
    isa: str  # inductor's vector ISA the source was generated for ("avx512", "avx2", ...)
    cpu_features: tuple[str, ...]  # /proc/cpuinfo flags the binary needs
    machine: str  # platform.machine() of the build


@dataclass(frozen=True)
class Variant:
    """One compiled graph: a hint point (dynamic) or exact sizes (static), and its guards."""

    index: int
    kind: VariantKind
    point: Mapping[str, int]
    guards: tuple[str, ...]
    payload: str
    code: str
    kernels: tuple[NativeKernel, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "point", MappingProxyType(dict(self.point)))


@dataclass(frozen=True)
class CalibrationEntry:
    """What running every admissible variant at one sample size measured."""

    point: tuple[int, ...]  # the sample sizes, in symbol order
    times: Mapping[int, float]  # variant index -> median seconds per call

    def __post_init__(self) -> None:
        object.__setattr__(self, "times", MappingProxyType(dict(self.times)))

    @property
    def ranking(self) -> tuple[int, ...]:
        """Variant indices, fastest first (ties: lower index first)."""
        return tuple(sorted(self.times, key=lambda v: (self.times[v], v)))

    @property
    def best(self) -> int:
        return self.ranking[0]

    @property
    def margin(self) -> float:
        """How much slower the runner-up is than the best (0.05 = 5%); 0 if alone."""
        ranking = self.ranking
        if len(ranking) < 2:
            return 0.0
        return self.times[ranking[1]] / self.times[ranking[0]] - 1.0


@dataclass(frozen=True)
class Calibration:
    """A dispatch table measured on one device: used only on a device of that name."""

    device_name: str
    method: str
    entries: tuple[CalibrationEntry, ...]
    # the compile-time choice stands unless the measured best beats it by more than this
    min_gain: float = 0.0


@dataclass(frozen=True)
class Manifest:
    environment: Environment
    symbols: tuple[Symbol, ...]
    inputs: tuple[InputSpec, ...]
    variants: tuple[Variant, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    calibration: Calibration | None = None

    @property
    def symbol_names(self) -> tuple[str, ...]:
        return tuple(symbol.name for symbol in self.symbols)

    @property
    def graph_digests(self) -> tuple[str, ...]:
        """Each variant payload (a compiled graph) once, in first-use order."""
        return tuple(dict.fromkeys(variant.payload for variant in self.variants))

    @property
    def kernel_digests(self) -> tuple[str, ...]:
        """Each built kernel binary once, in first-use order."""
        return tuple(dict.fromkeys(k.binary for v in self.variants for k in v.kernels))

    @property
    def payload_digests(self) -> tuple[str, ...]:
        """Every payload an artifact stores: graphs, then kernel binaries."""
        return tuple(dict.fromkeys((*self.graph_digests, *self.kernel_digests)))

    def to_json(self) -> dict[str, Any]:
        env = self.environment
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "environment": dict(vars(env)),
            "symbols": [
                {
                    "name": s.name,
                    "sources": [[src.input_index, src.dim] for src in s.sources],
                    "min": s.min,
                    "max": s.max,
                }
                for s in self.symbols
            ],
            "inputs": [
                {"kind": "tensor", "dtype": i.dtype, "device": i.device, "shape": list(i.shape)}
                if isinstance(i, TensorInput)
                else {"kind": "int", "value": i.value}
                for i in self.inputs
            ],
            "variants": [
                {
                    "kind": v.kind,
                    "point": dict(v.point),
                    "guards": list(v.guards),
                    "payload": v.payload,
                    "code": v.code,
                    "kernels": [
                        {
                            "key": k.key,
                            "binary": k.binary,
                            "isa": k.isa,
                            "cpu_features": list(k.cpu_features),
                            "machine": k.machine,
                        }
                        for k in v.kernels
                    ],
                }
                for v in self.variants
            ],
            "extra": dict(self.extra),
            "calibration": None
            if self.calibration is None
            else {
                "device_name": self.calibration.device_name,
                "method": self.calibration.method,
                "min_gain": self.calibration.min_gain,
                "entries": [
                    {"point": list(e.point), "times": {str(k): t for k, t in e.times.items()}}
                    for e in self.calibration.entries
                ],
            },
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=2, sort_keys=False).encode()


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
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
