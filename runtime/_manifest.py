"""The manifest: what an artifact promises about its graph, symbols and variants.

It is plain JSON in both formats (readable in the unpacked one); ``_manifest_reader``
validates it field by field on load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

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
