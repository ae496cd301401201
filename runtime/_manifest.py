"""The manifest: what an artifact promises about its graph, inputs and variants.

One schema, both directions: the dataclasses, ``Manifest.to_json`` and
``Manifest.from_json`` live here together, so a new field is one edit. It is plain JSON
in both formats (readable in the unpacked one). Loading an artifact runs its code, and
the manifest decides what runs, so the reader validates every field (type, range,
length, names) and reports any defect as :class:`CorruptArtifactError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ._errors import CorruptArtifactError, IncompatibleArtifactError
from ._expressions import check_expression, check_symbol_name

FORMAT_NAME = "precompile-artifact"
# 3: input layouts (strides, mutation, aliasing, grad), output structure, float inputs.
# 4: a variant may say how to run its generated code directly (``LeanCall``), with its
#    source as a payload; version 3 artifacts load as before (every variant through
#    upstream's deserializer).
# 5: a lean variant may launch Triton kernels from their shipped binaries (``TritonLaunch``)
#    and realign misaligned inputs as upstream does (``LeanCall.align``).
# 6: a manifest moved to another CUDA device (``moved_from``: its lean variants' code and
#    launches moved, its inductor payloads still compiled for that first device, so they
#    never run). Written only for such manifests; others stay version 5, and a reader of
#    version 5 refuses a moved one.
FORMAT_VERSION = 5
MOVED_FORMAT_VERSION = 6
READABLE_VERSIONS = (3, 4, 5, 6)
VariantKind = Literal["hint", "static"]
Mutation = Literal["none", "data", "metadata"]
_MAX_INT = 2**63 - 1
_MAX_ITEMS = 1_000_000
_MAX_TEXT = 4096
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_DEVICE = re.compile(r"^[a-z][a-z0-9_]{0,15}(:[0-9]{1,4})?$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_DYNAMO_ATTRIBUTE = re.compile(r"^_dynamo_[a-z_]{1,48}$")
_ARG_TYPES = re.compile(r"^[ObhilBHIKfd]{0,4096}$")  # torch's _StaticCudaLauncher codes
_TORCH_PATH = re.compile(r"^torch(\.[A-Za-z_][A-Za-z0-9_]{0,127}){1,6}$")


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


def contiguous_strides(shape: Sequence[int | str]) -> tuple[int | str, ...]:
    """Row-major strides of ``shape`` as manifest entries (ints, or expression texts)."""
    strides: list[int | str] = []
    running: int | str = 1
    for size in reversed(shape):
        strides.append(running)
        if isinstance(running, int) and isinstance(size, int):
            running = running * size
        elif running == 1:
            running = size
        elif size != 1:
            running = f"({running})*({size})"
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorInput:
    """A tensor input as the variants were compiled for it.

    ``stride`` entries are ints or expressions over the symbols. ``mutation`` says what
    the graph does to the input ("data": writes its values; "metadata": changes its
    shape or strides in place). ``aliased``: an output is a view of it. ``value``: the
    number a 0-d float input (a float Dynamo passed as a tensor) was specialized to.
    """

    dtype: str
    device: str
    shape: tuple[int | str, ...]
    stride: tuple[int | str, ...] | None = None  # None: row-major (hand-made manifests)
    storage_offset: int | None = 0  # None: symbolic (not checked)
    requires_grad: bool = False
    mutation: Mutation = "none"
    aliased: bool = False
    value: float | None = None
    # Dynamo marked it static (a module's parameter or buffer): its address is expected to
    # stay put between calls, so a CUDA graph uses it in place (and checks it did)
    static_address: bool = False
    # Its requires_grad reaches no output: it required grad when the variants were compiled
    # with grad enabled, and AOTAutograd still found no output (or written input) needing
    # grad (e.g. the graph runs under ``torch.no_grad()``), so a call may pass it requiring
    # grad to inference variants: eager's result would not be connected to autograd either
    grad_unused: bool = False
    # Its values index a table of this many rows (an embedding): outside [0, rows) a
    # compiled kernel would read out of bounds (or abort the process in its own check)
    index_rows: int | None = None
    # What the input is in the caller's code (``L['x']``): said in errors and listed by
    # ``CompiledArtifact.inputs``
    name: str | None = None

    def __post_init__(self) -> None:
        if self.stride is None:
            object.__setattr__(self, "stride", contiguous_strides(self.shape))

    @property
    def strides(self) -> tuple[int | str, ...]:
        assert self.stride is not None
        return self.stride


@dataclass(frozen=True)
class ProcessGroupSpec:
    """A process group the graph's collectives run over, as it was when compiling: the
    graph names it by ``name`` alone, so a process that runs the graph must have a group
    registered under that name with the same size, backend and members (global ranks)."""

    name: str
    size: int
    backend: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class IntInput:
    value: int | str
    name: str | None = None  # as TensorInput.name


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
class TritonLaunch:
    """One Triton kernel of a lean GPU variant, launched from its compiled binary (a cubin)
    through torch's static CUDA launcher, as inductor's own static launcher does: no
    Triton compiler, no inductor import. The compile side records the launcher inductor
    chose and ran for the variant (after its autotuning), so the fields repeat exactly
    what inductor's ``StaticTritonCompileResult.make_launcher`` would build."""

    name: str  # the name the wrapper passes to ``async_compile.triton``
    function: str  # the kernel's function name inside the binary
    binary: str  # sha256 of the binary, a payload
    device: int  # the CUDA device index it was compiled for and loads onto
    num_warps: int
    shared: int  # bytes of dynamic shared memory
    arg_types: str  # the static launcher's type codes, one per argument passed
    parameters: tuple[str, ...]  # what the wrapper's ``.run(...)`` passes, in order
    grid_prefix: tuple[tuple[str, str], ...]  # (name, expression) assigned before the grid
    grid: tuple[str, str, str]  # expressions over the parameters and prefix names
    arguments: tuple[str, ...]  # the parameters passed on to the kernel, in order
    scratch: int = 0  # trailing null pointers (Triton's global and profile scratch)


@dataclass(frozen=True)
class LeanCall:
    """How to run a variant's generated wrapper module directly: exec its source and call
    its ``call``, with no AOTAutograd wrapper and no torch compiler module imported.

    The compile side writes one only where it proved AOTAutograd's runtime wrapping of
    the graph trivial (an inference graph on CPU with no input mutation outside the
    graph, no output aliasing an input or intermediate, no subclass, RNG state or effect
    token, no constants) and every torch compiler name the source uses is one the runtime
    provides; what wrapping remains is recorded here and replayed exactly.
    """

    source: str  # sha256 of the wrapper module's source text (UTF-8), a payload
    externs: Mapping[str, str]  # ``extern_kernels.<name>`` -> the torch callable's path
    outputs: int  # how many values ``call`` returns (checked on every call, as upstream)
    # inputs the graph writes in place: their autograd version counters are bumped
    # before each call (what AOTAutograd does for mutations kept in the graph)
    bump_versions: tuple[int, ...] = ()
    # per output, the dims marked as dynamic for a Dynamo graph consuming it, and the
    # tensor attribute this torch marks them in (it differs between torch versions)
    dynamic_dims: tuple[tuple[int, tuple[int, ...]], ...] = ()
    dynamic_attribute: str | None = None
    # the Triton kernels its source creates with ``async_compile.triton`` (GPU variants)
    triton: tuple[TritonLaunch, ...] = ()
    # inputs compiled as 16-byte aligned: one that is not is copied to an aligned tensor
    # before the call, and copied back after it where the graph writes it (``realign``),
    # as inductor's wrapper does
    align: tuple[int, ...] = ()
    realign: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "externs", MappingProxyType(dict(self.externs)))


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
    lean: LeanCall | None = None  # None: runs through upstream's deserialized wrappers

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
    """Everything an artifact says about itself, besides the compiled code."""

    environment: Environment
    symbols: tuple[Symbol, ...]
    inputs: tuple[InputSpec, ...]
    variants: tuple[Variant, ...]
    calibration: Calibration | None = None
    # the variants carry a backward graph (compiled with grad enabled and inputs needing it)
    training: bool = False
    # pytree spec (upstream's JSON) of a graph whose output is not a flat tuple or list
    output: str | None = field(default=None)
    # each flat output's shape (ints and expressions over the symbols; None: not a tensor
    # or not known): what padded CUDA-graph replays slice their outputs by
    output_shapes: tuple[tuple[int | str, ...] | None, ...] | None = None
    # the CUDA-graph options a load uses unless it passes its own (CudaGraphs.to_json)
    cudagraphs: Mapping[str, Any] | None = None
    # the process groups the graph's collectives (``_c10d_functional``) run over
    process_groups: tuple[ProcessGroupSpec, ...] = ()
    # the CUDA device index its inductor payloads are compiled for, where ``to()`` moved
    # it to another (only its lean variants run: see ``_relocate``)
    moved_from: int | None = None
    # the graph draws from the caller's random generator (dropout in training, torch.rand):
    # no run but the caller's may happen (no warm-up run, no CUDA-graph capture)
    draws_random: bool = False

    @property
    def symbol_names(self) -> tuple[str, ...]:
        return tuple(symbol.name for symbol in self.symbols)

    @property
    def cuda_indices(self) -> tuple[int, ...]:
        """The CUDA devices its tensor inputs are on (what a run draws random numbers on)."""
        devices = {s.device for s in self.inputs if isinstance(s, TensorInput)}
        cuda = [d.partition(":") for d in devices if d.startswith("cuda")]
        return tuple(sorted({int(index or 0) for _, _, index in cuda}))

    @property
    def graph_digests(self) -> tuple[str, ...]:
        """Each variant payload (a compiled graph) once, in first-use order."""
        return tuple(dict.fromkeys(variant.payload for variant in self.variants))

    @property
    def kernel_digests(self) -> tuple[str, ...]:
        """Each built kernel binary once, in first-use order."""
        return tuple(dict.fromkeys(k.binary for v in self.variants for k in v.kernels))

    @property
    def source_digests(self) -> tuple[str, ...]:
        """Each lean variant's wrapper source once, in first-use order."""
        return tuple(dict.fromkeys(v.lean.source for v in self.variants if v.lean is not None))

    @property
    def triton_digests(self) -> tuple[str, ...]:
        """Each lean variant's Triton kernel binary once, in first-use order."""
        return tuple(
            dict.fromkeys(
                t.binary for v in self.variants if v.lean is not None for t in v.lean.triton
            )
        )

    @property
    def payload_digests(self) -> tuple[str, ...]:
        """Every payload an artifact stores: graphs, kernel binaries, lean sources, then
        Triton binaries. The one list of what an artifact (and so a cache entry)
        references."""
        return tuple(
            dict.fromkeys(
                (
                    *self.graph_digests,
                    *self.kernel_digests,
                    *self.source_digests,
                    *self.triton_digests,
                )
            )
        )

    def digest(self) -> str:
        """sha256 of the manifest's canonical JSON: names this artifact's contents."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    # -- writing -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        document = self._to_json()
        if self.process_groups:  # absent otherwise: earlier manifests keep their digests
            document["process_groups"] = [
                {"name": g.name, "size": g.size, "backend": g.backend, "ranks": list(g.ranks)}
                for g in self.process_groups
            ]
        if self.moved_from is not None:
            document["format_version"] = MOVED_FORMAT_VERSION
            document["moved_from"] = self.moved_from
        if self.draws_random:  # absent otherwise: earlier manifests keep their digests
            document["draws_random"] = True
        return document

    def _to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "environment": dict(vars(self.environment)),
            "symbols": [
                {
                    "name": s.name,
                    "sources": [[src.input_index, src.dim] for src in s.sources],
                    "min": s.min,
                    "max": s.max,
                }
                for s in self.symbols
            ],
            "inputs": [_input_to_json(i) for i in self.inputs],
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
                    "lean": _lean_to_json(v.lean),
                }
                for v in self.variants
            ],
            "training": self.training,
            "output": self.output,
            "cudagraphs": None if self.cudagraphs is None else dict(self.cudagraphs),
            "output_shapes": None
            if self.output_shapes is None
            else [None if shape is None else list(shape) for shape in self.output_shapes],
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

    # -- reading -------------------------------------------------------------------
    @staticmethod
    def from_json(data: Any) -> Manifest:
        """Validate a decoded manifest document; any defect is a CorruptArtifactError."""
        return _Reader().manifest(data)


def _as_text(value: Any) -> Any:
    """A grid expression as text (inductor writes constant grids as ints)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _lean_to_json(lean: LeanCall | None) -> dict[str, Any] | None:
    if lean is None:
        return None
    return {
        "source": lean.source,
        "externs": dict(lean.externs),
        "outputs": lean.outputs,
        "bump_versions": list(lean.bump_versions),
        "dynamic_dims": [[index, list(dims)] for index, dims in lean.dynamic_dims],
        "dynamic_attribute": lean.dynamic_attribute,
        "triton": [_triton_to_json(t) for t in lean.triton],
        "align": list(lean.align),
        "realign": list(lean.realign),
    }


def _triton_to_json(launch: TritonLaunch) -> dict[str, Any]:
    return {
        "name": launch.name,
        "function": launch.function,
        "binary": launch.binary,
        "device": launch.device,
        "num_warps": launch.num_warps,
        "shared": launch.shared,
        "arg_types": launch.arg_types,
        "parameters": list(launch.parameters),
        "grid_prefix": [list(pair) for pair in launch.grid_prefix],
        "grid": list(launch.grid),
        "arguments": list(launch.arguments),
        "scratch": launch.scratch,
    }


def _input_to_json(spec: InputSpec) -> dict[str, Any]:
    named = {} if spec.name is None else {"name": spec.name}
    if isinstance(spec, IntInput):
        return {"kind": "int", "value": spec.value, **named}
    return {
        **named,
        "kind": "tensor",
        "dtype": spec.dtype,
        "device": spec.device,
        "shape": list(spec.shape),
        "stride": list(spec.strides),
        "storage_offset": spec.storage_offset,
        "requires_grad": spec.requires_grad,
        "mutation": spec.mutation,
        "aliased": spec.aliased,
        "value": spec.value,
        "static_address": spec.static_address,
        "grad_unused": spec.grad_unused,
        **({} if spec.index_rows is None else {"index_rows": spec.index_rows}),
    }


class _Reader:
    """Field-by-field validation of a manifest document."""

    version = FORMAT_VERSION  # the document's format version, once read

    def keys(self, raw: Mapping[str, Any], wanted: set[str], where: str) -> None:
        """``raw`` has exactly the keys ``wanted`` (else the error names both sides)."""
        if set(raw) != wanted:
            extra, missing = sorted(set(raw) - wanted), sorted(wanted - set(raw))
            said = "; ".join(
                part
                for part in (
                    f"unexpected keys {[str(k)[:40] for k in extra[:8]]}" if extra else "",
                    f"missing keys {missing}" if missing else "",
                )
                if part
            )
            raise CorruptArtifactError(
                f"manifest field {where} has {said} (expected {sorted(wanted)})"
            )

    def expect(self, value: Any, kind: type | tuple[type, ...], where: str) -> Any:
        numeric = kind in (int, float) or (isinstance(kind, tuple) and (int in kind))
        if not isinstance(value, kind) or (numeric and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise CorruptArtifactError(
                f"manifest field {where} should be {names}, got {value!r:.80}"
            )
        if isinstance(value, (list, dict)) and len(value) > _MAX_ITEMS:
            raise CorruptArtifactError(f"manifest field {where} has {len(value)} items")
        return value

    def text(self, value: Any, where: str, *, limit: int = _MAX_TEXT) -> str:
        text = self.expect(value, str, where)
        if len(text) > limit:
            raise CorruptArtifactError(f"manifest field {where} is {len(text)} characters long")
        return str(text)

    def optional_text(self, value: Any, where: str) -> str | None:
        return None if value is None else self.text(value, where)

    def input_name(self, value: Any, where: str) -> str | None:
        """An input's name: printable text of at most 200 characters (it is shown)."""
        if value is None:
            return None
        text = self.expect(value, str, where)
        if len(text) > 200 or not text.isprintable():
            raise CorruptArtifactError(f"manifest field {where} is not a short printable name")
        return str(text)

    def integer(self, value: Any, where: str, *, low: int = 0, high: int = _MAX_INT) -> int:
        number = self.expect(value, int, where)
        if not low <= number <= high:
            shown = str(number) if abs(number) < 10**30 else "a number of over 30 digits"
            raise CorruptArtifactError(
                f"manifest field {where} is {shown}, outside [{low}, {high}]"
            )
        return int(number)

    def number(self, value: Any, where: str) -> float:
        number = float(self.expect(value, (int, float), where))
        if not -1e300 < number < 1e300:
            raise CorruptArtifactError(f"manifest field {where} is not a finite number")
        return number

    def boolean(self, value: Any, where: str) -> bool:
        return bool(self.expect(value, bool, where))

    def digest(self, value: Any, where: str) -> str:
        text = self.expect(value, str, where)
        if not _HEX64.match(text):
            raise CorruptArtifactError(f"manifest field {where} is not a sha256 hex digest")
        return str(text)

    def size(self, value: Any, names: Sequence[str], where: str) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            return self.integer(value, where)
        return check_expression(self.text(value, where), names)

    # -- sections --------------------------------------------------------------------
    def manifest(self, data: Any) -> Manifest:
        self.expect(data, dict, "<root>")
        if data.get("format") != FORMAT_NAME:
            raise CorruptArtifactError(
                f"not a precompile artifact (format={data.get('format')!r:.80})"
            )
        version = self.integer(data.get("format_version"), "format_version", high=2**31)
        self.version = version
        if version not in READABLE_VERSIONS:
            raise IncompatibleArtifactError(
                f"artifact format version {version} is not supported (this precompile reads "
                f"version {', '.join(map(str, READABLE_VERSIONS))}); formats before 3 did not "
                "record input layouts, so their calls cannot be checked: recompile"
            )
        environment = self.environment(data.get("environment"))
        inputs_raw = self.expect(data.get("inputs"), list, "inputs")
        symbols = self.symbols(data.get("symbols"), len(inputs_raw))
        names = [s.name for s in symbols]
        inputs = tuple(
            self.input(entry, names, f"inputs[{n}]") for n, entry in enumerate(inputs_raw)
        )
        for symbol in symbols:
            for source in symbol.sources:
                self.check_source(source, symbol.name, inputs)
        variants = self.variants(data.get("variants"), names, len(inputs))
        output = data.get("output")
        return Manifest(
            environment=environment,
            symbols=symbols,
            inputs=inputs,
            variants=variants,
            calibration=self.calibration(data.get("calibration"), len(names), len(variants)),
            training=self.boolean(data.get("training"), "training"),
            output=None if output is None else self.text(output, "output", limit=1_000_000),
            output_shapes=self.output_shapes(data.get("output_shapes"), names),
            cudagraphs=self.cudagraphs(data.get("cudagraphs"), names),
            process_groups=self.process_groups(data.get("process_groups")),
            moved_from=self.moved_from(data.get("moved_from"), variants),
            draws_random=self.boolean(data.get("draws_random", False), "draws_random"),
        )

    def moved_from(self, value: Any, variants: tuple[Variant, ...]) -> int | None:
        if (value is None) != (self.version < MOVED_FORMAT_VERSION):
            raise CorruptArtifactError(
                f"manifest format version {self.version} with moved_from={value!r:.40}"
            )
        if value is None:
            return None
        if any(v.lean is None for v in variants):
            raise CorruptArtifactError("a moved manifest has a variant with no lean call")
        return self.integer(value, "moved_from", high=1023)

    def process_groups(self, value: Any) -> tuple[ProcessGroupSpec, ...]:
        if value is None:
            return ()
        groups: list[ProcessGroupSpec] = []
        for n, entry in enumerate(self.expect(value, list, "process_groups")):
            where = f"process_groups[{n}]"
            self.expect(entry, dict, where)
            if set(entry) != {"name", "size", "backend", "ranks"}:
                raise CorruptArtifactError(f"manifest field {where} has unexpected keys")
            size = self.integer(entry["size"], f"{where}.size", low=1, high=1 << 24)
            ranks = self.expect(entry["ranks"], list, f"{where}.ranks")
            if len(ranks) != size:
                raise CorruptArtifactError(f"manifest field {where} lists {len(ranks)} ranks")
            groups.append(
                ProcessGroupSpec(
                    name=self.text(entry["name"], f"{where}.name", limit=256),
                    size=size,
                    backend=self.text(entry["backend"], f"{where}.backend", limit=256),
                    ranks=tuple(self.integer(r, f"{where}.ranks", high=1 << 24) for r in ranks),
                )
            )
        return tuple(groups)

    def cudagraphs(self, value: Any, names: Sequence[str]) -> dict[str, Any] | None:
        if value is None:
            return None
        raw = self.expect(value, dict, "cudagraphs")
        if set(raw) != {"capture_sizes", "max_graphs", "pad", "copy_outputs"}:
            raise CorruptArtifactError("manifest field cudagraphs has unexpected keys")
        sizes: list[int | list[int]] = []
        for n, item in enumerate(
            self.expect(raw["capture_sizes"], list, "cudagraphs.capture_sizes")
        ):
            where = f"cudagraphs.capture_sizes[{n}]"
            if isinstance(item, list):
                sizes.append([self.integer(v, where) for v in item])
            else:
                sizes.append(self.integer(item, where))
        pad: bool | list[str]
        if isinstance(raw["pad"], bool):
            pad = raw["pad"]
        else:
            pad = [
                self.text(p, "cudagraphs.pad", limit=64)
                for p in self.expect(raw["pad"], list, "cudagraphs.pad")
            ]
            if not set(pad) <= set(names):
                raise CorruptArtifactError("manifest field cudagraphs.pad names unknown symbols")
        return {
            "capture_sizes": sizes,
            "max_graphs": self.integer(
                raw["max_graphs"], "cudagraphs.max_graphs", low=1, high=1 << 20
            ),
            "pad": pad,
            "copy_outputs": self.boolean(raw["copy_outputs"], "cudagraphs.copy_outputs"),
        }

    def output_shapes(
        self, value: Any, names: Sequence[str]
    ) -> tuple[tuple[int | str, ...] | None, ...] | None:
        if value is None:
            return None
        shapes: list[tuple[int | str, ...] | None] = []
        for n, shape in enumerate(self.expect(value, list, "output_shapes")):
            where = f"output_shapes[{n}]"
            if shape is None:
                shapes.append(None)
                continue
            sizes = self.expect(shape, list, where)
            if len(sizes) > 64:
                raise CorruptArtifactError(f"manifest field {where} has {len(sizes)} dims")
            shapes.append(tuple(self.size(v, names, f"{where}[{d}]") for d, v in enumerate(sizes)))
        return tuple(shapes)

    def environment(self, value: Any) -> Environment:
        raw = self.expect(value, dict, "environment")
        required = {"torch", "torch_git", "python", "platform", "device_type", "device_name"}
        optional = {"cuda", "triton"}
        unknown = set(raw) - required - optional - {"capability"}
        if unknown or not required <= set(raw):
            raise CorruptArtifactError(
                f"manifest field environment should have keys {sorted(required | optional)}, "
                f"got {sorted(raw)[:20]}"
            )
        fields = {k: self.text(raw[k], f"environment.{k}") for k in required}
        return Environment(
            **fields,
            cuda=self.optional_text(raw.get("cuda"), "environment.cuda"),
            triton=self.optional_text(raw.get("triton"), "environment.triton"),
            capability=self.text(raw.get("capability", ""), "environment.capability"),
        )

    def symbols(self, value: Any, input_count: int) -> tuple[Symbol, ...]:
        symbols: list[Symbol] = []
        seen: set[str] = set()
        for n, entry in enumerate(self.expect(value, list, "symbols")):
            self.expect(entry, dict, f"symbols[{n}]")
            name = check_symbol_name(entry.get("name"))
            if name in seen:
                raise CorruptArtifactError(f"symbol {name} is listed twice")
            seen.add(name)
            sources = []
            for m, pair in enumerate(
                self.expect(entry.get("sources"), list, f"symbols[{n}].sources")
            ):
                where = f"symbols[{n}].sources[{m}]"
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise CorruptArtifactError(f"manifest field {where} should be [index, dim]")
                index = self.integer(pair[0], where, high=max(0, input_count - 1))
                dim = None if pair[1] is None else self.integer(pair[1], where, high=64)
                sources.append(SymbolSource(index, dim))
            if not sources:
                raise CorruptArtifactError(f"symbol {name} has no source in the inputs")
            low = self.integer(entry.get("min", 0), f"symbols[{n}].min")
            high_raw = entry.get("max")
            high = None if high_raw is None else self.integer(high_raw, f"symbols[{n}].max")
            symbols.append(Symbol(name, tuple(sources), low, high))
        return tuple(symbols)

    def check_source(self, source: SymbolSource, name: str, inputs: Sequence[InputSpec]) -> None:
        spec = inputs[source.input_index]
        if source.dim is None:
            ok = isinstance(spec, IntInput) and spec.value == name
        else:
            ok = (
                isinstance(spec, TensorInput)
                and source.dim < len(spec.shape)
                and spec.shape[source.dim] == name
            )
        if not ok:
            raise CorruptArtifactError(
                f"symbol {name} is said to be read from input {source.input_index}"
                f"{'' if source.dim is None else f' dim {source.dim}'}, which is not that symbol"
            )

    def input(self, entry: Any, names: Sequence[str], where: str) -> InputSpec:
        self.expect(entry, dict, where)
        kind = entry.get("kind")
        name = self.input_name(entry.get("name"), f"{where}.name")
        if kind == "int":
            return IntInput(self.size(entry.get("value"), names, f"{where}.value"), name=name)
        if kind != "tensor":
            raise CorruptArtifactError(f"manifest field {where}.kind is unknown")
        dtype = self.text(entry.get("dtype"), f"{where}.dtype")
        device = self.text(entry.get("device"), f"{where}.device")
        if not _DTYPE.match(dtype) or not _DEVICE.match(device):
            raise CorruptArtifactError(f"manifest field {where} names dtype/device oddly")
        shape = self.expect(entry.get("shape"), list, f"{where}.shape")
        stride = self.expect(entry.get("stride"), list, f"{where}.stride")
        if len(shape) > 64 or len(stride) != len(shape):
            raise CorruptArtifactError(
                f"manifest field {where} has {len(shape)} sizes and {len(stride)} strides"
            )
        mutation = entry.get("mutation")
        if mutation not in ("none", "data", "metadata"):
            raise CorruptArtifactError(f"manifest field {where}.mutation is unknown")
        value = entry.get("value")
        return TensorInput(
            dtype=dtype,
            device=device,
            shape=tuple(self.size(v, names, f"{where}.shape[{d}]") for d, v in enumerate(shape)),
            stride=tuple(self.size(v, names, f"{where}.stride[{d}]") for d, v in enumerate(stride)),
            storage_offset=None
            if entry.get("storage_offset") is None
            else self.integer(entry.get("storage_offset"), f"{where}.storage_offset"),
            requires_grad=self.boolean(entry.get("requires_grad"), f"{where}.requires_grad"),
            mutation=mutation,
            aliased=self.boolean(entry.get("aliased"), f"{where}.aliased"),
            value=None if value is None else self.number(value, f"{where}.value"),
            static_address=self.boolean(
                entry.get("static_address", False), f"{where}.static_address"
            ),
            grad_unused=self.boolean(entry.get("grad_unused", False), f"{where}.grad_unused"),
            name=name,
            index_rows=None
            if entry.get("index_rows") is None
            else self.integer(entry.get("index_rows"), f"{where}.index_rows", high=2**62),
        )

    def variants(self, value: Any, names: Sequence[str], input_count: int) -> tuple[Variant, ...]:
        variants: list[Variant] = []
        for n, entry in enumerate(self.expect(value, list, "variants")):
            where = f"variants[{n}]"
            self.expect(entry, dict, where)
            kind = entry.get("kind")
            if kind not in ("hint", "static"):
                raise CorruptArtifactError(f"manifest field {where}.kind is unknown")
            point = self.expect(entry.get("point"), dict, f"{where}.point")
            if sorted(point) != sorted(names):
                raise CorruptArtifactError(
                    f"manifest field {where}.point does not name every symbol"
                )
            guards = tuple(
                check_expression(self.text(g, f"{where}.guards", limit=10_000), names)
                for g in self.expect(entry.get("guards"), list, f"{where}.guards")
            )
            variants.append(
                Variant(
                    index=n,
                    kind=kind,
                    point={
                        name: self.integer(point[name], f"{where}.point[{name}]") for name in names
                    },
                    guards=guards,
                    payload=self.digest(entry.get("payload"), f"{where}.payload"),
                    code=self.digest(entry.get("code"), f"{where}.code"),
                    kernels=self.kernels(entry.get("kernels"), f"{where}.kernels"),
                    lean=self.lean(entry.get("lean"), f"{where}.lean", input_count),
                )
            )
        if not variants:
            raise CorruptArtifactError("manifest lists no variants")
        return tuple(variants)

    def lean(self, value: Any, where: str, input_count: int) -> LeanCall | None:
        if value is None:
            return None
        if self.version < 4:
            raise CorruptArtifactError(
                f"manifest field {where} is a lean call, which format {self.version} has not"
            )
        raw = self.expect(value, dict, where)
        keys = {"source", "externs", "outputs", "bump_versions", "dynamic_dims"}
        keys |= {"dynamic_attribute"}
        if self.version >= 5:  # format 5 added Triton launches and input realignment
            keys |= {"triton", "align", "realign"}
        self.keys(raw, keys, where)
        externs: dict[str, str] = {}
        table = self.expect(raw["externs"], dict, f"{where}.externs")
        if len(table) > 1024:
            raise CorruptArtifactError(f"manifest field {where}.externs has {len(table)} items")
        for name, path in table.items():
            path = self.text(path, f"{where}.externs", limit=256)
            compiler = {"_inductor", "_dynamo"} & set(path.split("."))
            if not _IDENTIFIER.match(name) or not _TORCH_PATH.match(path) or compiler:
                raise CorruptArtifactError(
                    f"manifest field {where}.externs maps {name!r:.40} to {path!r:.80}, not "
                    "an identifier to a dotted path under torch outside its compiler"
                )
            externs[name] = path
        outputs = self.integer(raw["outputs"], f"{where}.outputs", high=_MAX_ITEMS)
        high = max(0, input_count - 1)
        bumps = tuple(
            self.integer(i, f"{where}.bump_versions", high=high)
            for i in self.expect(raw["bump_versions"], list, f"{where}.bump_versions")
        )
        if bumps and not input_count:
            raise CorruptArtifactError(f"manifest field {where}.bump_versions names no input")
        dims: list[tuple[int, tuple[int, ...]]] = []
        for n, pair in enumerate(self.expect(raw["dynamic_dims"], list, f"{where}.dynamic_dims")):
            at = f"{where}.dynamic_dims[{n}]"
            if not (isinstance(pair, list) and len(pair) == 2):
                raise CorruptArtifactError(f"manifest field {at} should be [output, [dims]]")
            index = self.integer(pair[0], at, high=max(0, outputs - 1))
            if not outputs:
                raise CorruptArtifactError(f"manifest field {at} names no output")
            listed = self.expect(pair[1], list, at)
            if len(listed) > 64:
                raise CorruptArtifactError(f"manifest field {at} has {len(listed)} dims")
            dims.append((index, tuple(self.integer(d, at, high=63) for d in listed)))
        attribute = raw["dynamic_attribute"]
        if attribute is not None:
            attribute = self.text(attribute, f"{where}.dynamic_attribute", limit=64)
        if (attribute is None) != (not dims) or (
            attribute is not None and not _DYNAMO_ATTRIBUTE.match(attribute)
        ):
            raise CorruptArtifactError(
                f"manifest field {where}.dynamic_attribute should name a _dynamo_ tensor "
                "attribute exactly when dynamic_dims lists outputs"
            )
        launches = tuple(
            self.triton_launch(item, f"{where}.triton[{n}]")
            for n, item in enumerate(self.expect(raw.get("triton", []), list, f"{where}.triton"))
        )
        if len({launch.name for launch in launches}) != len(launches):
            raise CorruptArtifactError(f"manifest field {where}.triton names a kernel twice")
        align, realign = (
            tuple(
                self.integer(i, f"{where}.{key}", high=high)
                for i in self.expect(raw.get(key, []), list, f"{where}.{key}")
            )
            for key in ("align", "realign")
        )
        if ((align or realign) and not input_count) or not set(realign) <= set(align):
            raise CorruptArtifactError(
                f"manifest field {where}.realign should list inputs that {where}.align lists"
            )
        return LeanCall(
            source=self.digest(raw["source"], f"{where}.source"),
            externs=externs,
            outputs=outputs,
            bump_versions=bumps,
            dynamic_dims=tuple(dims),
            dynamic_attribute=attribute,
            triton=launches,
            align=align,
            realign=realign,
        )

    def identifiers(self, value: Any, where: str, *, limit: int = 4096) -> tuple[str, ...]:
        listed = self.expect(value, list, where)
        if len(listed) > limit or not all(
            isinstance(n, str) and _IDENTIFIER.match(n) for n in listed
        ):
            raise CorruptArtifactError(f"manifest field {where} should list identifiers")
        return tuple(listed)

    def triton_launch(self, value: Any, where: str) -> TritonLaunch:
        raw = self.expect(value, dict, where)
        keys = {
            "name", "function", "binary", "device", "num_warps", "shared", "arg_types",
            "parameters", "grid_prefix", "grid", "arguments", "scratch",
        }  # fmt: skip
        self.keys(raw, keys, where)
        name, function = (
            self.text(raw[k], f"{where}.{k}", limit=128) for k in ("name", "function")
        )
        if not (_IDENTIFIER.match(name) and _IDENTIFIER.match(function)):
            raise CorruptArtifactError(
                f"manifest field {where} names a kernel that is no identifier"
            )
        arg_types = self.text(raw["arg_types"], f"{where}.arg_types", limit=4096)
        if not _ARG_TYPES.match(arg_types):
            raise CorruptArtifactError(
                f"manifest field {where}.arg_types should be static launcher type codes"
            )
        parameters = self.identifiers(raw["parameters"], f"{where}.parameters")
        prefix: list[tuple[str, str]] = []
        for n, pair in enumerate(self.expect(raw["grid_prefix"], list, f"{where}.grid_prefix")):
            at = f"{where}.grid_prefix[{n}]"
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise CorruptArtifactError(f"manifest field {at} should be [name, expression]")
            if not _IDENTIFIER.match(pair[0]) or n >= 16:
                raise CorruptArtifactError(f"manifest field {at} assigns no identifier")
            known = (*parameters, *(p for p, _ in prefix))
            prefix.append((pair[0], check_expression(pair[1], known)))
        known = (*parameters, *(p for p, _ in prefix))
        grid = self.expect(raw["grid"], list, f"{where}.grid")
        if len(grid) != 3:
            raise CorruptArtifactError(f"manifest field {where}.grid should hold 3 expressions")
        arguments = self.identifiers(raw["arguments"], f"{where}.arguments")
        scratch = self.integer(raw["scratch"], f"{where}.scratch", high=2)
        if not set(arguments) <= set(parameters) or len(arguments) + scratch != len(arg_types):
            raise CorruptArtifactError(
                f"manifest field {where}.arguments should be parameters, one per type code "
                "besides the scratch pointers"
            )
        return TritonLaunch(
            name=name,
            function=function,
            binary=self.digest(raw["binary"], f"{where}.binary"),
            device=self.integer(raw["device"], f"{where}.device", high=1023),
            num_warps=self.integer(raw["num_warps"], f"{where}.num_warps", low=1, high=64),
            shared=self.integer(raw["shared"], f"{where}.shared", high=2**31),
            arg_types=arg_types,
            parameters=parameters,
            grid_prefix=tuple(prefix),
            grid=(
                check_expression(_as_text(grid[0]), known),
                check_expression(_as_text(grid[1]), known),
                check_expression(_as_text(grid[2]), known),
            ),
            arguments=arguments,
            scratch=scratch,
        )

    def kernels(self, value: Any, where: str) -> tuple[NativeKernel, ...]:
        kernels = []
        for n, entry in enumerate(self.expect(value, list, where)):
            at = f"{where}[{n}]"
            self.expect(entry, dict, at)
            features = self.expect(entry.get("cpu_features"), list, f"{at}.cpu_features")
            kernels.append(
                NativeKernel(
                    key=self.digest(entry.get("key"), f"{at}.key"),
                    binary=self.digest(entry.get("binary"), f"{at}.binary"),
                    isa=self.text(entry.get("isa"), f"{at}.isa", limit=64),
                    cpu_features=tuple(
                        self.text(f, f"{at}.cpu_features", limit=64) for f in features
                    ),
                    machine=self.text(entry.get("machine"), f"{at}.machine", limit=64),
                )
            )
        return tuple(kernels)

    def calibration(self, value: Any, symbols: int, variants: int) -> Calibration | None:
        if value is None:
            return None
        self.expect(value, dict, "calibration")
        entries = []
        for n, entry in enumerate(self.expect(value.get("entries"), list, "calibration.entries")):
            where = f"calibration.entries[{n}]"
            self.expect(entry, dict, where)
            point = tuple(
                self.integer(v, f"{where}.point")
                for v in self.expect(entry.get("point"), list, f"{where}.point")
            )
            if len(point) != symbols:
                raise CorruptArtifactError(
                    f"manifest field {where}.point does not size every symbol"
                )
            times: dict[int, float] = {}
            for key, seconds in self.expect(entry.get("times"), dict, f"{where}.times").items():
                if not (
                    isinstance(key, str)
                    and key.isascii()
                    and key.isdigit()
                    and len(key) <= 9
                    and int(key) < variants
                ):
                    raise CorruptArtifactError(
                        f"manifest field {where}.times names no variant ({key!r:.20})"
                    )
                times[int(key)] = self.number(seconds, f"{where}.times[{key}]")
            if not times:
                raise CorruptArtifactError(f"manifest field {where}.times is empty")
            entries.append(CalibrationEntry(point, times))
        min_gain = self.number(value.get("min_gain", 0.0), "calibration.min_gain")
        if not min_gain >= 0:
            raise CorruptArtifactError(
                f"manifest field calibration.min_gain is {min_gain}, not >= 0"
            )
        return Calibration(
            device_name=self.text(value.get("device_name"), "calibration.device_name"),
            method=self.text(value.get("method"), "calibration.method"),
            entries=tuple(entries),
            min_gain=min_gain,
        )
