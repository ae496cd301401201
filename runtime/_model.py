"""A whole model compiled as one graph, run with no Dynamo: ``CompiledModel``.

The compile side traced the model once and recorded a plan: how a call's arguments (a
pytree of args and kwargs) and the model's parameters and buffers map onto the graph's
flat inputs, and how the model's output (a ``transformers`` ModelOutput, say) is rebuilt
from the graph's flat outputs. Here a call is flattened, checked against that plan,
run through the artifact (whose input contract checks every tensor), and rebuilt.

What is checked: at bind, every guard Dynamo's trace recorded on the model, its
forward's closure and its module's globals (``_model_guards``), again after a
registration in the bound model; per call, the call's structure, every non-tensor
argument (equal to the traced value), every tensor argument and every parameter/buffer
(the artifact's contract: dtype, device, rank, static sizes, strides, grad mode), that
the sizes fit a variant, the training flags the trace read, and the global state
(``_global_state``). A plain attribute assigned in place after binding is seen at the
next bind only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules import module as _modules_of_torch  # its global hooks, read per call

from precompile.cache import cache_to_read, resolve_trusted_keys

from . import _torch_adapter as adapter
from ._artifact import CompiledArtifact
from ._binary_format import read_binary_with_model, write_binary
from ._cached import load_cached_model
from ._contract import label_index
from ._cudagraphs import why_not_capturable
from ._decode_graphs import DecodeGraphs, GraphedSteps
from ._decode_loop import decode_loop, step_graph_key
from ._environment import check_compatible
from ._errors import (
    ArtifactNotFoundError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    InputMismatchError,
    InvalidOptionError,
    NoVariantError,
)
from ._global_state import StateCheck
from ._kv_cache import (
    CacheGuard,
    CacheLayout,
    CacheSlot,
    KVCacheKind,
    caches_from_json,
    is_kv_cache,
    kv_cache_capacity,
    layouts_to_json,
    parse_cache_binding,
    slot_specs,
)
from ._manifest import Manifest, TensorInput
from ._model_guards import BoundGuards, TraceRead
from ._model_identity import (
    NO_FILE,
    check_identity,
    class_path,
    code_digest,
    file_digest,
    fileless_functions,
)
from ._process_groups import this_rank
from ._sampling import Sampling
from ._unbound import UnboundTensor

log = logging.getLogger("precompile.runtime")
PLAN_FORMAT = "precompile-model-plan"
# 2: the trace's guards and global state (``trace_read``); 3: tensor arguments the graph
# does not take (``unbound``). A plan of an older version is stale (compile_model
# compiles again; load_model refuses it)
PLAN_VERSION = 3
_CONSTANT_TYPES = (bool, int, float, str, type(None))


def _same_constant(got: Any, traced: Any) -> bool:
    """Whether a non-tensor argument is the traced one: floats by sign too (a forward
    may read the sign of -0.0, which equals 0.0) and NaN as NaN."""
    if type(traced) is float:
        if math.isnan(traced):
            return math.isnan(got)
        return bool(got == traced and math.copysign(1.0, got) == math.copysign(1.0, traced))
    return bool(got == traced)


@dataclass(frozen=True)
class ModelPlan:
    """How a model's calls map onto one compiled graph (JSON both ways, validated)."""

    model_class: str
    in_spec: str  # pytree spec (upstream's JSON) of (args, kwargs); caches are leaves
    bindings: tuple[tuple[str, Any], ...]  # per graph input: parameter|buffer|leaf|size|cache
    constants: Mapping[int, Any]  # non-tensor argument leaves and their traced values
    out_spec: str  # pytree spec of the model's output
    # per output leaf: ("graph", i) | ("constant", v) | ("cache", leaf): the caller's cache
    outputs: tuple[tuple[str, Any], ...]
    traced_files: Mapping[str, str]  # source file -> sha256, all Dynamo traced
    training: bool
    # the key factors of the model it was compiled from (``_model_identity``); a load
    # binds the plan only to a model they still describe
    identity: Mapping[str, str] = field(default_factory=dict)
    # KV cache arguments (leaf -> layout); a "cache" binding is (leaf, layer, field)
    caches: Mapping[int, CacheLayout] = field(default_factory=dict)
    tokens: tuple[int, int] | None = None  # (leaf, dim): the tokens a call writes per cache
    position_leaf: int | None = None  # a cache_position argument, checked against the cache
    # (rank, world size, backend) it was traced on under torch.distributed: the trace may
    # have baked the rank in, so the plan binds only on that rank of such a world
    distributed: tuple[int, int, str] | None = None
    # what the trace read (Dynamo's guards, the global state), checked at bind and per call
    trace_read: TraceRead | None = None
    # Lengths below Dynamo's bound of 2: per dynamic length, the (leaf, dim) a call's
    # length is read at; the graph above serves every length >= 2 (its variants are
    # guarded so), and each piece is a trace of its own with the lengths it names (by
    # index into ``lengths``) at 1, as Dynamo would trace them apart. Raw JSON
    # ({"ones", "manifest", "plan"}): built into compiled models where a plan is bound.
    lengths: tuple[tuple[int, int], ...] = ()
    pieces: tuple[Mapping[str, Any], ...] = ()
    # tensor argument leaves the graph does not take, as traced (``_unbound``)
    unbound: Mapping[int, UnboundTensor] = field(default_factory=dict)
    # sizes the caller declared a dynamic dim takes, (leaf, dim, least, most or None):
    # the graphs are guarded to them; kept here to say so when a call is refused
    ranges: tuple[tuple[int, int, int, int | None], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model_class": self.model_class,
            "in_spec": self.in_spec,
            "bindings": [list(b) for b in self.bindings],
            "constants": [[k, v] for k, v in sorted(self.constants.items())],
            "out_spec": self.out_spec,
            "outputs": [list(o) for o in self.outputs],
            "traced_files": dict(self.traced_files),
            "training": self.training,
            "identity": dict(self.identity),
            "caches": layouts_to_json(self.caches),
            "tokens": list(self.tokens) if self.tokens is not None else None,
            "position_leaf": self.position_leaf,
            "distributed": None if self.distributed is None else list(self.distributed),
            "trace_read": None if self.trace_read is None else self.trace_read.to_json(),
            "lengths": [list(place) for place in self.lengths],
            "pieces": [dict(piece) for piece in self.pieces],
            "unbound": [[leaf, spec.to_json()] for leaf, spec in sorted(self.unbound.items())],
            "ranges": [list(r) for r in self.ranges],
        }

    @staticmethod
    def from_json(value: Any, graph_inputs: int) -> ModelPlan:
        where = "model plan"
        if not isinstance(value, dict) or value.get("format") != PLAN_FORMAT:
            raise CorruptArtifactError(f"{where} is missing or not a model plan")
        if value.get("version") != PLAN_VERSION:
            raise IncompatibleArtifactError(
                f"{where} version {value.get('version')!r} is not this precompile's "
                f"({PLAN_VERSION}): it was saved by another version; compile the model again"
            )

        def text(item: Any, field: str, limit: int = 1 << 20) -> str:
            if not isinstance(item, str) or len(item) > limit:
                raise CorruptArtifactError(f"{where} field {field} is not a string")
            return item

        bindings: list[tuple[str, Any]] = []
        raw = value.get("bindings")
        if not isinstance(raw, list) or len(raw) != graph_inputs:
            raise CorruptArtifactError(f"{where} binds {len(raw or [])} of {graph_inputs} inputs")
        for n, binding in enumerate(raw):
            ok = isinstance(binding, list) and len(binding) == 2
            kind, target = binding if ok else ("", None)
            named = kind in ("parameter", "buffer") and isinstance(target, str)
            if (named and len(str(target)) < 4096) or (
                kind == "leaf" and type(target) is int and target >= 0
            ):
                bindings.append((str(kind), target))
            elif (
                kind == "size"
                and isinstance(target, list)
                and len(target) == 2
                and all(type(t) is int and t >= 0 for t in target)
            ):
                bindings.append((kind, (target[0], target[1])))
            elif kind == "cache" and (cached := parse_cache_binding(target)) is not None:
                bindings.append((kind, cached))
            else:
                raise CorruptArtifactError(f"{where} field bindings[{n}] is malformed")
        constants: dict[int, Any] = {}
        for pair in value.get("constants", []):
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int):
                raise CorruptArtifactError(f"{where} field constants is malformed")
            if not isinstance(pair[1], _CONSTANT_TYPES):
                raise CorruptArtifactError(f"{where} constant {pair[0]} has an unknown type")
            constants[pair[0]] = pair[1]
        outputs: list[tuple[str, Any]] = []
        for n, output in enumerate(value.get("outputs") or []):
            ok = isinstance(output, list) and len(output) == 2
            kind, target = output if ok else ("", None)
            graph = kind in ("graph", "cache") and type(target) is int and target >= 0
            if graph or (kind == "constant" and isinstance(target, _CONSTANT_TYPES)):
                outputs.append((str(kind), target))
            else:
                raise CorruptArtifactError(f"{where} field outputs[{n}] is malformed")
        files = value.get("traced_files")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items()
        ):
            raise CorruptArtifactError(f"{where} field traced_files is malformed")
        if not isinstance(value.get("training"), bool):
            raise CorruptArtifactError(f"{where} field training is not a bool")
        identity = value.get("identity", {})  # absent in plans saved before it was recorded
        if not isinstance(identity, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) < 64 and len(v) < 4096
            for k, v in identity.items()
        ):
            raise CorruptArtifactError(f"{where} field identity is malformed")
        caches = caches_from_json(value.get("caches"), where)
        tokens = value.get("tokens")
        if tokens is not None and not (
            isinstance(tokens, list) and len(tokens) == 2 and all(type(t) is int for t in tokens)
        ):
            raise CorruptArtifactError(f"{where} field tokens is malformed")
        position = value.get("position_leaf")
        if position is not None and type(position) is not int:
            raise CorruptArtifactError(f"{where} field position_leaf is malformed")
        distributed = value.get("distributed")
        if distributed is not None and not (
            isinstance(distributed, list)
            and len(distributed) == 3
            and type(distributed[0]) is int
            and type(distributed[1]) is int
            and isinstance(distributed[2], str)
            and len(distributed[2]) < 256
        ):
            raise CorruptArtifactError(f"{where} field distributed is malformed")
        for kind, target in bindings:
            if kind == "cache" and target[0] not in caches:
                raise CorruptArtifactError(f"{where} binds cache leaf {target[0]}, not a cache")
        if caches and tokens is None:
            raise CorruptArtifactError(f"{where} has caches but no token count")
        return ModelPlan(
            model_class=text(value.get("model_class"), "model_class", 4096),
            in_spec=text(value.get("in_spec"), "in_spec"),
            bindings=tuple(bindings),
            constants=constants,
            out_spec=text(value.get("out_spec"), "out_spec"),
            outputs=tuple(outputs),
            traced_files=files,
            training=value["training"],
            identity=identity,
            caches=caches,
            tokens=(tokens[0], tokens[1]) if tokens is not None else None,
            position_leaf=position,
            distributed=None
            if distributed is None
            else (distributed[0], distributed[1], distributed[2]),
            trace_read=TraceRead.from_json(value.get("trace_read")),
            lengths=_lengths_from_json(value.get("lengths", []), where),
            pieces=_pieces_from_json(value.get("pieces", []), where),
            unbound=_unbound_from_json(value.get("unbound"), where),
            ranges=_ranges_from_json(value.get("ranges", []), where),
        )


def _unbound_from_json(value: Any, where: str) -> dict[int, UnboundTensor]:
    if not isinstance(value, list) or len(value) > 4096:
        raise CorruptArtifactError(f"{where} field unbound is malformed")
    found: dict[int, UnboundTensor] = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int):
            raise CorruptArtifactError(f"{where} field unbound is malformed")
        found[pair[0]] = UnboundTensor.from_json(pair[1], f"{where} unbound leaf {pair[0]}")
    return found


def _lengths_from_json(value: Any, where: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(i) is int and i >= 0 for i in p)
        for p in value
    ):
        raise CorruptArtifactError(f"{where} field lengths is malformed")
    return tuple((p[0], p[1]) for p in value)


def _ranges_from_json(value: Any, where: str) -> tuple[tuple[int, int, int, int | None], ...]:
    def natural(item: Any) -> bool:
        return type(item) is int and item >= 0

    if not isinstance(value, list) or len(value) > 4096 or not all(
        isinstance(r, list) and len(r) == 4 and all(natural(i) for i in r[:3])
        and (r[3] is None or natural(r[3]))
        for r in value
    ):  # fmt: skip
        raise CorruptArtifactError(f"{where} field ranges is malformed")
    return tuple((r[0], r[1], r[2], r[3]) for r in value)


def _pieces_from_json(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise CorruptArtifactError(f"{where} field pieces is malformed")
    for piece in value:
        ones = piece.get("ones") if isinstance(piece, dict) else None
        if not (
            isinstance(ones, list)
            and ones
            and all(type(i) is int and i >= 0 for i in ones)
            and isinstance(piece.get("manifest"), dict)
            and isinstance(piece.get("plan"), dict)
        ):
            raise CorruptArtifactError(f"{where} field pieces is malformed")
    return tuple(value)


def changed_files(plan: ModelPlan) -> list[str]:
    """The traced source files that differ from (or are gone since) the trace; code
    defined where no file is (``<no file: module.function>``) is looked up by name."""
    fileless = None
    changed = []
    for place, digest in plan.traced_files.items():
        if place.startswith(NO_FILE):
            if fileless is None:
                fileless = fileless_functions()
            code = fileless.get(place[len(NO_FILE) : -1])
            if code is None or code_digest(code) != digest:
                changed.append(place)
        elif file_digest(place) != digest:
            changed.append(place)
    return changed


def stale_reason(plan: ModelPlan) -> str | None:
    """Why a plan found under its own key cannot serve (the key is computed without
    tracing, so it cannot see these), or None: a source file the trace read changed
    (a helper the forward calls, say), or the plan predates recording its model."""
    changed = changed_files(plan)
    if changed:
        return f"source files changed since it was compiled: {', '.join(changed[:3])}"
    if not plan.identity:
        return "it was saved by an older precompile, without what it was compiled from"
    return None


def _prompt_lengths(lengths: Any, capacity: int | None) -> list[int]:
    """``prepare_generate``'s prompt lengths, checked: ints >= 1 that fit the cache."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise InvalidOptionError(f"prompt_lengths must be a sequence of ints, got {lengths!r}")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidOptionError(f"prompt_lengths must hold ints >= 1, got {n!r}")
        if capacity is not None and n > capacity:
            raise InvalidOptionError(
                f"prompt length {n} does not fit the cache (max_cache_len {capacity})"
            )
    return list(dict.fromkeys(lengths))


class CompiledModel:
    """``model`` compiled as one graph: call it like the model (same arguments, same
    return value); no Dynamo frame is traced and nothing compiles."""

    def __init__(
        self,
        model: torch.nn.Module,
        artifact: CompiledArtifact,
        plan: ModelPlan,
        pieces: Mapping[frozenset[int], CompiledModel] | None = None,
    ):
        if class_path(model) != plan.model_class:
            raise IncompatibleArtifactError(
                f"the compiled plan is for {plan.model_class}, this model is {class_path(model)}"
            )
        self.model = model
        self.artifact = artifact
        artifact.require_traced_grad_flags()  # the forward's Python may branch on them
        self.plan = plan
        if plan.trace_read is None:
            raise IncompatibleArtifactError(
                "the compiled plan records nothing of what its trace read; compile it again"
            )
        where = f"the model compiled as {plan.model_class}"
        # every guard of the trace, checked against this model now (refused if any fails)
        self._guards = BoundGuards(plan.trace_read, model, where)
        self._state = StateCheck(plan.trace_read.state, where)
        self._in_spec = adapter.treespec_from_json(plan.in_spec)
        self._out_spec = adapter.treespec_from_json(plan.out_spec)
        self._weights = self._resolve_weights(model, plan, artifact.manifest)
        self._names = _leaf_names(self._in_spec)
        self._flat_names = _flat_keywords(self._in_spec)
        self._caches = self._cache_guard(plan, artifact.manifest) if plan.caches else None
        self.cache_key: str | None = None
        self._lengths = plan.lengths
        self.pieces = dict(pieces) if pieces is not None else self._bind_pieces(model, plan)
        self._decode_graphs: DecodeGraphs | None = None  # made at the first graphed generate

    def _bind_pieces(
        self, model: torch.nn.Module, plan: ModelPlan
    ) -> dict[frozenset[int], CompiledModel]:
        """The plan's pieces (traces at lengths below 2), bound to ``model`` too; their
        payloads come from where this graph's do (a file, or a cache entry)."""
        found: dict[frozenset[int], CompiledModel] = {}
        for raw in plan.pieces:
            manifest = Manifest.from_json(raw["manifest"])
            missing = [d for d in manifest.payload_digests if not self.artifact.has_payload(d)]
            if missing:
                raise CorruptArtifactError(f"a compiled model lacks payload {missing[0][:12]}")
            check_compatible(manifest.environment, "a compiled model's piece")
            artifact = CompiledArtifact(manifest, self.artifact.payload_store)
            piece_plan = ModelPlan.from_json(raw["plan"], len(manifest.inputs))
            if piece_plan.pieces or any(i >= len(plan.lengths) for i in raw["ones"]):
                raise CorruptArtifactError("a compiled model's piece is malformed")
            found[frozenset(raw["ones"])] = CompiledModel(model, artifact, piece_plan, {})
        return found

    def _piece_for(self, leaves: list[Any]) -> CompiledModel | None:
        """The piece that serves a call whose lengths include 1 (None: this graph, which
        refuses 0 and serves 2 and more)."""
        ones = []
        for index, (leaf, dim) in enumerate(self._lengths):
            value = leaves[leaf]
            if isinstance(value, torch.Tensor) and dim < value.dim():
                size = value.shape[dim]
                if size == 0:
                    return None  # refused by this graph's variants, which say why
                if size == 1:
                    ones.append(index)
        if not ones:
            return None
        piece = self.pieces.get(frozenset(ones))
        if piece is None:
            said = ", ".join(self._length_name(i) for i in ones)
            raise NoVariantError(
                f"no trace of the model serves {said} at 1: when it was compiled, the "
                "model's own forward refused such a call or could not be traced there "
                "(compile_model logged which), so calls with those lengths are refused",
                sizes={self._length_name(i): 1 for i in ones},
                candidates=(),
            )
        return piece

    def _length_name(self, index: int) -> str:
        leaf, dim = self._lengths[index]
        return f"{self._names[leaf]} dim {dim}"

    def refused_at_one(self) -> list[tuple[str, int]]:
        """The dynamic lengths, as (argument, dim), that no trace serves at 1 alone: a
        call with that length at 1 is refused (``NoVariantError``), since the model's
        forward refused such a call or could not be traced there when it was compiled, or
        its declared range starts above 1."""
        declared = [(self._names[leaf], dim) for leaf, dim, least, _ in self.plan.ranges
                    if least >= 2 and leaf < len(self._names)]  # fmt: skip
        return declared + [
            (self._names[leaf], dim)
            for index, (leaf, dim) in enumerate(self._lengths)
            if frozenset({index}) not in self.pieces
        ]

    def __repr__(self) -> str:
        graphs = self.artifact.cudagraphs is not None
        pieces = "".join(
            f", piece at {'/'.join(str(i) for i in sorted(ones))} = 1" for ones in self.pieces
        )
        key = f" key={self.cache_key[:12]}" if self.cache_key else ""
        return (
            f"<precompile.CompiledModel of {self.plan.model_class}{key}: "
            f"{len(self.artifact.variants)} variants{pieces}"
            f"{', cuda graphs' if graphs else ''}; {self.artifact!r}>"
        )

    def check_model(self) -> None:
        """Check every guard of the trace against the model now, as a bind does (a few
        ms): after changing what no per-call check sees (a plain attribute, a class
        attribute, a config field, a module global), refused here with
        ``IncompatibleArtifactError`` naming it, rather than served as compiled."""
        self._guards.bind()
        self._weights = self._resolve_weights(self.model, self.plan, self.artifact.manifest)
        for piece in self.pieces.values():
            piece.check_model()

    def skip_guard_eval_unsafe(self, skip: bool = True) -> CompiledModel:
        """Stop (``skip=True``) or resume checking, per call, that every value the trace
        read is still the one bound: attributes, class attributes and ``forward``s,
        module globals, list items, functions' code, ``os.environ``. This is what
        ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` does for
        ``torch.compile``, for a server that changes none of them: that check is most of
        a call's host time in a deep model (docs/benchmarks.md, "Dispatch overhead").
        Unsafe: a value changed while skipped is answered from the traced graph, a wrong
        answer with no error. Still checked per call: the inputs and caches, the mode and
        training flags, global state, a hook registered anywhere, submodules, parameters
        and buffers registered; ``check_model()`` checks everything once (the skip
        stays), and resuming checks against the values bound. For this model and its
        pieces; returns the model."""
        if not isinstance(skip, bool):
            raise InvalidOptionError(
                f"skip_guard_eval_unsafe takes True or False, not {skip!r} ({type(skip).__name__})"
            )
        for compiled in (self, *self.pieces.values()):
            compiled._guards.reads_per_call = not skip
        return self

    def set_cudagraphs(self, cudagraphs: Any, *, save: bool = False) -> CompiledModel:
        """CUDA graphs (``CudaGraphs``) in this process for this graph and every piece
        (generate's step graphs, captured under the old setting, are dropped). ``save``
        keeps the compile's default unless ``save=True`` (see ``CompiledArtifact``)."""
        self.artifact.set_cudagraphs(cudagraphs, save=save)
        self._decode_graphs = None
        for piece in self.pieces.values():
            piece.artifact.set_cudagraphs(cudagraphs, save=save)
        return self

    def _cache_guard(self, plan: ModelPlan, manifest: Manifest) -> CacheGuard:
        """The checks of the call's KV cache arguments (see ``precompile.runtime._kv_cache``)."""
        slots = []
        for leaf, layout in sorted(plan.caches.items()):
            keys, values = slot_specs(
                plan.bindings, manifest.inputs, leaf, len(layout.layer_classes)
            )
            slots.append(CacheSlot(leaf, self._names[leaf], layout, keys, values))
        assert plan.tokens is not None  # from_json refuses caches without it
        tokens_leaf, tokens_dim = plan.tokens

        def tokens(leaves: list[Any]) -> int:
            value = leaves[tokens_leaf]
            if not isinstance(value, torch.Tensor) or value.dim() <= tokens_dim:
                raise InputMismatchError(
                    f"{self._names[tokens_leaf]} should be a tensor whose dim {tokens_dim} is "
                    f"the call's token count, got {type(value).__name__}",
                    input_name=str(self._names[tokens_leaf]),
                    expected="Tensor",
                    got=type(value).__name__,
                )
            return int(value.shape[tokens_dim])

        return CacheGuard(slots, tokens, self._size_reader(slots[0].keys[0].shape[0], manifest),
                          plan.position_leaf)  # fmt: skip

    def _size_reader(self, size: int | str, manifest: Manifest) -> Any:
        """A function of a call's leaves giving ``size``: an int, or a symbol read off an
        argument that carries it."""
        if isinstance(size, int):
            return lambda leaves: size
        for symbol in manifest.symbols:
            if symbol.name != size:
                continue
            for source in symbol.sources:
                kind, target = self.plan.bindings[source.input_index]
                if kind == "leaf" and source.dim is not None:
                    leaf, dim = target, source.dim
                    return lambda leaves: int(leaves[leaf].shape[dim])
        raise CorruptArtifactError(f"no argument of the call carries the size {size}")

    @staticmethod
    def _resolve_weights(
        model: torch.nn.Module, plan: ModelPlan, manifest: Manifest
    ) -> dict[int, tuple[dict[str, Any], str]]:
        """Per graph input bound to a parameter or buffer: the dict it lives in and its
        key there, so each call reads the module's current tensor (a parameter replaced
        after compiling is what the call sees, and what the contract checks)."""
        found: dict[int, tuple[dict[str, Any], str]] = {}
        for index, (kind, name) in enumerate(plan.bindings):
            if kind not in ("parameter", "buffer"):
                continue
            owner_name, _, leaf = name.rpartition(".")
            try:
                owner = model.get_submodule(owner_name)
            except AttributeError:
                raise IncompatibleArtifactError(
                    f"this model has no submodule {owner_name!r}"
                ) from None
            table = owner._parameters if kind == "parameter" else owner._buffers
            if leaf not in table or not isinstance(manifest.inputs[index], TensorInput):
                raise IncompatibleArtifactError(f"this model has no {kind} {name!r}")
            found[index] = (table, leaf)
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = self._flat_leaves(args, kwargs)
        if leaves is None:
            leaves = self._leaves(args, kwargs)
        try:
            return self._serving(leaves)._call(leaves)
        except InputMismatchError:
            said = self._shape_refusal(leaves)
            if said is None:
                raise
            raise said from None
        except NoVariantError:
            outside = self._range_refusal(leaves)
            if outside is None:
                raise
            raise outside from None

    def _range_refusal(self, leaves: list[Any]) -> NoVariantError | None:
        """Where a refused call has a dim outside the range the caller declared for it at
        compile time: that, in the call's terms (the guards' words name symbols)."""
        for leaf, dim, least, most in self.plan.ranges:
            value = leaves[leaf] if leaf < len(leaves) else None  # a plan edited by hand
            if not isinstance(value, torch.Tensor) or dim >= value.dim():
                continue
            size = int(value.shape[dim])
            if size < least or (most is not None and size > most):
                name = f"{self._names[leaf]} dim {dim}"
                return NoVariantError(
                    f"{name} is {size}, outside the range [{least}, "
                    f"{'no bound' if most is None else most}] it was compiled for "
                    "(compile_model's dynamic=); compile with a range that holds it",
                    sizes={name: size},
                    candidates=(),
                )
        return None

    def _shape_refusal(self, leaves: list[Any]) -> InputMismatchError | None:
        """Where a refused call has a tensor argument of another rank, or another size in
        a static dim, than the model was compiled for: that, in the call's terms (the
        argument's name, dynamic lengths as ``*``). The graph that refused it may be a
        piece (a trace at length 1, chosen by a dim of size 1: a ``(1, 1, 12)`` ids tensor
        was told the piece's "rank 2 with shape (1, 1)"), whose contract is not the
        call's, and the graph's own words name graph inputs and symbols."""
        inputs = self.artifact.manifest.inputs
        for index, (kind, target) in enumerate(self.plan.bindings):
            spec, value = inputs[index], leaves[target] if kind == "leaf" else None
            if not isinstance(spec, TensorInput) or not isinstance(value, torch.Tensor):
                continue
            shape = spec.shape
            if value.dim() == len(shape) and all(
                not isinstance(size, int) or size == int(got)
                for size, got in zip(shape, value.shape, strict=True)
            ):
                continue
            wanted = ", ".join(str(size) if isinstance(size, int) else "*" for size in shape)
            return InputMismatchError(
                f"{self._names[target]} should have rank {len(shape)} with shape ({wanted}) "
                f"(*: a dynamic length), the shape the model was compiled for; got shape "
                f"{tuple(value.shape)}",
                input_name=str(self._names[target]),
                expected=tuple(size if isinstance(size, int) else "*" for size in shape),
                got=tuple(value.shape),
            )
        return None

    def _serving(self, leaves: list[Any]) -> CompiledModel:
        """This graph, or the piece that serves a call of these leaves."""
        if self._lengths:
            piece = self._piece_for(leaves)
            if piece is not None:
                return piece
        return self

    def _unguarded_step(self, **kwargs: Any) -> Any:
        """A call as ``__call__`` makes it, without the cache guard's host-side length
        check and mirror (which would wait for the GPU inside a capture and not advance
        on replays): for the decode loop's step graph, whose loop checked the lengths
        before its first step and drops the mirror after its last."""
        leaves = self._leaves((), kwargs)
        return self._serving(leaves)._call(leaves, guard_caches=False)

    def _step_layouts(self, arguments: dict[str, Any]) -> tuple[Hashable, ...]:
        """A keyword call's per-call checks (as ``__call__`` makes them, but for the
        cache's lengths), then each graph input's address, dtype, shape and strides (a
        non-tensor as it is): what a step graph replayed for the call must have seen at
        capture, since it reads every tensor where and as it was then."""
        leaves = self._leaves((), arguments)
        serving = self._serving(leaves)
        serving._check_call(leaves)
        return tuple(
            (t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor)
            else t
            for t in serving._graph_inputs(leaves)
        )  # fmt: skip

    def _call(self, leaves: list[Any], *, guard_caches: bool = True) -> Any:
        self._check_call(leaves)
        caches = self._caches if guard_caches else None
        if caches is None:
            results = self._run(leaves)
        else:
            tokens = caches.before(leaves)
            try:
                results = self._run(leaves)
            except BaseException:
                caches.forget(leaves)
                raise
            caches.after(leaves, tokens)
        outputs = [
            results[target] if kind == "graph" else leaves[target] if kind == "cache" else target
            for kind, target in self.plan.outputs
        ]
        return adapter.tree_unflatten(outputs, self._out_spec)

    def _check_call(self, leaves: list[Any]) -> None:
        """What every call checks before it runs, but the inputs and the caches (the
        artifact and the cache guard check those): the compiled constants, the mode,
        global state, hooks and what the trace read of the model."""
        for index, value in self.plan.constants.items():
            if type(leaves[index]) is not type(value) or not _same_constant(leaves[index], value):
                raise InputMismatchError(
                    f"argument leaf {index} is {leaves[index]!r}, but the model was compiled "
                    f"for {value!r}; compile again for that value",
                    input_name=str(self._names[index]),
                    expected=value,
                    got=leaves[index],
                )
        for index, spec in self.plan.unbound.items():
            failure = spec.failure(leaves[index], leaves)
            if failure is not None:
                raise InputMismatchError(
                    f"{self._names[index]} {failure}: the compiled graph does not take it, "
                    "yet the trace may have read it (Dynamo's tensor guard checks this), so "
                    "it is held to what the trace saw; compile again for it",
                    input_name=str(self._names[index]),
                )
        if self.model.training != self.plan.training:
            mode = "train()" if self.model.training else "eval()"
            raise InputMismatchError(
                f"the model is in {mode} mode, but was compiled in the other; switch back"
            )
        self._state.check()
        hooked = hooks_on(self.model)
        if hooked:
            raise InputMismatchError(
                f"{hooked} is registered: a compiled model runs none of the model's Python, "
                "its hooks neither (eager would run it); remove it, or compile the model "
                "with it registered on a submodule"
            )
        if self._guards.check():  # something was registered in the model: bound again
            self._weights = self._resolve_weights(self.model, self.plan, self.artifact.manifest)

    def _leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """A call's argument leaves (keyword order is not part of a call: kwargs are
        flattened sorted by name), checked against the compiled call structure."""
        leaves, spec = adapter.tree_flatten(
            (args, dict(sorted(kwargs.items()))), is_leaf=is_kv_cache
        )
        if spec != self._in_spec:
            said, compiled = adapter.call_structure(spec), adapter.call_structure(self._in_spec)
            if said == compiled:  # the same arguments, nested differently
                said, compiled = str(spec), str(self._in_spec)
            raise InputMismatchError(
                f"this call's arguments are structured as {said}, but the model was compiled "
                f"for {compiled}; compile again for this call structure",
                expected=compiled,
                got=said,
            )
        return leaves

    def _flat_leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        """The leaves of a keyword-only call of plain leaves (a decode step's), read
        without pytree; None where the call is not one (the general path decides)."""
        names = self._flat_names
        if names is None or args or len(kwargs) != len(names):
            return None
        try:
            leaves = [kwargs[name] for name in names]
        except KeyError:
            return None
        for leaf in leaves:
            if type(leaf) not in _FLAT_LEAF_TYPES and not is_kv_cache(leaf):
                return None
        return leaves

    def _run(self, leaves: list[Any]) -> Any:
        try:
            return self.artifact(*self._graph_inputs(leaves))
        except InputMismatchError as exc:
            graph_names = [spec.name for spec in self.artifact.manifest.inputs]
            index = label_index(exc.input_name, graph_names)
            raise exc.restated(
                self._named(exc, leaves),
                input_name=None if index is None else self._input_name(index),
            ) from None

    def _named(self, exc: InputMismatchError, leaves: list[Any]) -> str:
        """The artifact's message with each graph input it names said as the model's
        argument, parameter or cache tensor, and a cache's difference in cache terms."""
        names = [self._input_name(index) for index in range(len(self.plan.bindings))]
        text = re.sub(  # the artifact's own name for an input, if it said one, is replaced
            r"\binput (\d+)\b(?: \((?:[^()]|\([^()]*\))*\))?",
            lambda m: (
                f"input {m.group(1)} ({names[int(m.group(1))]})"
                if int(m.group(1)) < len(names)
                else m.group(0)
            ),
            str(exc),
        )
        explained = self._caches.explain(leaves) if self._caches is not None else None
        return f"{explained} ({text})" if explained else text

    def _input_name(self, index: int) -> str:
        kind, target = self.plan.bindings[index]
        if kind == "leaf":
            return str(self._names[target])
        if kind == "cache":
            leaf, layer, field_name = target
            return KVCacheKind.place(self._names[leaf], layer, field_name)
        if kind == "size":
            return f"size of {self._names[target[0]]} dim {target[1]}"
        return f"{kind} {target}"

    def _graph_inputs(self, leaves: list[Any]) -> list[Any]:
        """The graph's flat inputs for a call's argument leaves: leaves, sizes read off
        them, and the module's current parameters and buffers."""
        flat: list[Any] = []
        for index, (kind, target) in enumerate(self.plan.bindings):
            if kind == "leaf":
                flat.append(leaves[target])
            elif kind == "size":
                leaf, dim = target
                tensor = leaves[leaf]
                # -1 where there is no such dim: the input check then names the argument
                known = isinstance(tensor, torch.Tensor) and dim < tensor.dim()
                flat.append(int(tensor.shape[dim]) if known else -1)
            elif kind == "cache":
                leaf, layer, name = target
                flat.append(getattr(leaves[leaf].layers[layer], name))
            else:
                table, name = self._weights[index]
                try:
                    flat.append(table[name])
                except KeyError:  # ``del module.weight`` after binding (no hook sees it)
                    raise InputMismatchError(
                        f"{kind} {target} was deleted from the model after it was bound; "
                        "the compiled graph reads it: register it again or compile the "
                        "model again",
                        input_name=str(target),
                    ) from None
        return flat

    # -- the decode loop ---------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        past_key_values: Any,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill the prompts, then decode up to ``max_new_tokens`` tokens per row, every
        step served by this compiled model (compiled for a keyword call of ``input_ids``
        and a ``StaticCache`` ``past_key_values``; see ``_decode_loop``). Returns the
        prompts followed by the new tokens, ``[batch, length + new]``, as transformers'
        ``generate`` returns its sequences: greedy by default; ``do_sample=True`` samples
        after ``temperature``, ``top_k`` and ``top_p`` (none applied unless given) from
        ``generator`` (else torch's default one). Rows stop at ``eos_token_id`` and are
        filled with ``pad_token_id`` after; the loop ends when every row has. Prompts of
        different lengths come left-padded with ``attention_mask`` (``[batch, length]``,
        0 at padding), for a model compiled with an ``attention_mask`` of
        ``[batch, max_cache_len]`` (and ``position_ids``, derived from the mask as
        transformers does). The cache is written in place: pass a fresh (or ``reset()``)
        one, large enough for the prompt and the new tokens; one cache serves one
        generate at a time. With CUDA graphs on, the whole decode step (forward, token
        choice, the advance of its inputs) is captured once per batch, cache and
        settings and replayed per token (docs/decode.md)."""
        sampling = Sampling.of(
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )  # fmt: skip
        return self._generate(input_ids, past_key_values, max_new_tokens, sampling, attention_mask)

    def _generate(
        self,
        input_ids: torch.Tensor,
        past_key_values: Any,
        max_new_tokens: int,
        sampling: Sampling,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if ("input_ids", 1) in self.refused_at_one():
            raise NoVariantError(
                "this model serves no call of one token (input_ids dim 1 at 1: its declared "
                "range starts above 1, or no trace serves it), and every decode step is one; "
                "compile it for lengths from 1",
                sizes={"input_ids dim 1": 1},
                candidates=(),
            )
        names = [n for n in dict.fromkeys(self._names) if n]
        constants = {self._names[i]: v for i, v in self.plan.constants.items()}
        with torch.no_grad():
            return decode_loop(
                self, names, constants, input_ids, past_key_values,
                max_new_tokens=max_new_tokens, sampling=sampling, attention_mask=attention_mask,
                held=None if self._caches is None else self._caches.held,
                graphed=self._graphed_steps(input_ids),
            )  # fmt: skip

    def prepare_generate(
        self,
        past_key_values: Any,
        batch_size: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        prompt_lengths: Sequence[int] = (),
    ) -> bool:
        """Capture, now, the decode-step graph that ``generate`` replays on this cache for
        ``batch_size`` prompts with these options (as ``generate`` takes them;
        ``generator``: only whether one is given counts, its state is neither read nor
        advanced), so that a request's first decode step is a replay: no capture and no
        per-shape setup (cuDNN's plans are built per thread; a graph replays in any).
        ``prompt_lengths``: also the prefill's graph at each of these prompt lengths (a
        server's length buckets), so a request's prefill at one is a replay too.
        Runs short made-up generates on the cache, ``reset()`` after each: pass an empty
        cache; it is left empty, initialized (as its first write would). Returns whether
        the step graph is kept for it (False: capturing failed, logged; ``generate`` on it
        runs its steps without one, as it would have; a prefill size whose capture fails
        is logged and runs plainly). Needs CUDA graphs on and a CUDA model."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidOptionError(f"batch_size must be an int >= 1, got {batch_size!r}")
        sampling = Sampling.of(
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )  # fmt: skip
        if not is_kv_cache(past_key_values):
            raise InvalidOptionError(
                "past_key_values must be a transformers StaticCache, got "
                f"{type(past_key_values).__name__}"
            )
        lengths = _prompt_lengths(prompt_lengths, kv_cache_capacity(past_key_values))
        device = torch.device(self._input_device("input_ids"))
        ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        graphed = self._graphed_steps(ids)
        if graphed is None:
            if device.type != "cuda":
                why = f"this model takes input_ids on {device} (a graph replays GPU work only)"
            elif self.artifact.cudagraphs is None:
                why = "CUDA graphs are off (compile or load with cudagraphs=True)"
            else:
                why = why_not_capturable(self.artifact.manifest) or "its graph cannot be captured"
            raise InvalidOptionError(f"prepare_generate captures CUDA graphs, but {why}")
        sampling.check_device(device)
        # A generator of its own stands for the caller's (the key says only "one given");
        # without one, sampling draws from torch's default, whose state is given back.
        scratch = None if generator is None else torch.Generator(device=generator.device)
        made_up = dataclasses.replace(sampling, generator=scratch)
        caches = self._caches
        assert caches is not None  # a model without a cache has no graphed steps
        held = caches.held(past_key_values)
        if held:  # refused before anything is written (reset() would lose its tokens)
            raise InvalidOptionError(
                f"past_key_values already holds {held} tokens: prepare_generate takes an "
                "empty cache (it runs a made-up generate on it, then resets it)"
            )
        # The step graph (3 tokens: its capture is at the 2nd step), then each prefill
        # size twice (a graph that writes the cache is captured at its 2nd call).
        runs = [(ids, 3)] + [
            (torch.zeros(batch_size, n, dtype=torch.long, device=device), 1)
            for n in lengths
            for _ in range(2)
        ]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for prompt, new in runs:
                try:
                    self._generate(prompt, past_key_values, new, made_up)
                finally:  # made-up tokens never stay in the caller's cache
                    if caches.held(past_key_values):
                        past_key_values.reset()
        names = [n for n in dict.fromkeys(self._names) if n]
        return step_graph_key(batch_size, names, past_key_values, sampling) in graphed.graphs

    def _input_device(self, name: str) -> str:
        """The device the model was compiled to take argument ``name`` on."""
        for index, (kind, target) in enumerate(self.plan.bindings):
            spec = self.artifact.manifest.inputs[index]
            if kind == "leaf" and self._names[target] == name and isinstance(spec, TensorInput):
                return spec.device
        raise InvalidOptionError(f"this model was compiled without a tensor argument {name!r}")

    def _graphed_steps(self, input_ids: Any) -> GraphedSteps | None:
        """How generate captures its decode step, where CUDA graphs are on and can
        capture this model's graph (else None: each step is a checked call)."""
        if (
            self.artifact.cudagraphs is None
            or self._caches is None
            or not isinstance(input_ids, torch.Tensor)
            or input_ids.device.type != "cuda"
            or why_not_capturable(self.artifact.manifest) is not None
        ):
            return None
        if self._decode_graphs is None:
            self._decode_graphs = DecodeGraphs(self._step_layouts)
        return GraphedSteps(self._decode_graphs, self._unguarded_step, self._caches.drop)

    # -- warm-up ---------------------------------------------------------------------
    def warmup(self, *, background: bool = False) -> CompiledModel:
        """Load every variant and run each once at its own point, with the model's own
        weights (copies of the parameters and buffers its graph writes in place: warm-up
        writes none of the model's state) and made-up arguments (``background=True``: in
        a thread that stops at interpreter exit), so that no size pays a first-use cost
        once warm-up is done."""
        templates: list[Any] = [None] * len(self.plan.bindings)
        for index, (table, name) in self._weights.items():
            templates[index] = table[name]
        self.artifact.warmup(background=background, inputs=templates, runnable=self._runnable())
        for piece in self.pieces.values():
            piece.warmup(background=background)
        return self

    def _runnable(self) -> Any:
        """With a KV cache, a variant runs at its point in warm-up (on made-up caches of
        length 0) only where its tokens fit the cache: a hint beyond max_cache_len would
        write past the made-up cache's end."""
        if self._caches is None or self.plan.tokens is None:
            return None
        manifest = self.artifact.manifest
        capacity = self._caches.slots[0].keys[0].shape[2]
        leaf, dim = self.plan.tokens
        spec = next(
            (
                manifest.inputs[i]
                for i, (kind, target) in enumerate(self.plan.bindings)
                if kind == "leaf" and target == leaf
            ),
            None,
        )
        size = spec.shape[dim] if isinstance(spec, TensorInput) else None
        if not isinstance(capacity, int) or size is None:
            return lambda point: False
        if isinstance(size, int):
            return lambda point: size <= capacity
        return lambda point: size in point and point[size] <= capacity

    def wait_warm(self, timeout: float | None = None) -> bool:
        warm = self.artifact.wait_warm(timeout)
        return all([warm, *(piece.wait_warm(timeout) for piece in self.pieces.values())])

    def explain(self, *args: Any, **kwargs: Any) -> Any:
        """Which variant a call with these arguments runs, and why. A fresh KV cache is
        explained as the call would initialize it, on a copy: explaining writes nothing."""
        leaves, spec = adapter.tree_flatten(
            (args, dict(sorted(kwargs.items()))), is_leaf=is_kv_cache
        )
        if self._caches is not None:
            initialized = self._caches.initialized_copies(leaves)
            if initialized is not leaves:
                leaves = initialized
                args, kwargs = adapter.tree_unflatten(leaves, spec)
        piece = self._piece_for(leaves) if self._lengths else None
        if piece is not None:
            return piece.explain(*args, **kwargs)
        flat = self._graph_inputs(leaves)
        return self.artifact.explain(*flat)

    # -- persistence -----------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, signing_key: Any = None) -> None:
        """One file: the compiled graph's artifact with the plan in its index."""
        write_binary(
            os.fspath(path),
            self.artifact.manifest,
            self.artifact._payloads,
            signing_key,
            model=self.plan.to_json(),
            more=[(p.artifact.manifest, p.artifact.payload_store) for p in self.pieces.values()],
        )

    @staticmethod
    def load(
        model: torch.nn.Module,
        path: str | os.PathLike[str] | None = None,
        *,
        cache: Any = None,
        key: str | None = None,
        tag: str | None = None,
        trusted_keys: Any = None,
        cudagraphs: Any = None,
        warmup: bool | str = "background",
    ) -> CompiledModel:
        """Bind a saved model plan (a file from ``save``, or a cache entry by ``key`` or
        ``tag``) to ``model``. The traced source files must be unchanged, and ``model`` must be what
        it was compiled from: its class, module sources, config and submodule settings,
        and its parameters' and buffers' names, shapes, dtypes and devices (else
        ``IncompatibleArtifactError`` naming the factor; tensors are checked per call too)."""
        if sum(x is not None for x in (path, key, tag)) != 1:
            raise InvalidOptionError("load_model takes exactly one of path=, key= or tag=")
        if tag is not None:
            key = cache_to_read(cache).tagged(tag)
            if key is None:
                raise ArtifactNotFoundError(f"no entry is tagged {tag!r} in the cache", key=tag)
        if path is not None:
            source = os.fspath(path)
            where = f"the compiled model {source!r}"
            try:
                manifest, payloads, _, raw_plan = read_binary_with_model(
                    source, resolve_trusted_keys(trusted_keys)
                )
            except CorruptArtifactError as exc:
                if exc.path is None:  # the reader's checks see bytes; the file is known here
                    exc.path = source
                raise
            except FileNotFoundError as exc:  # one of ours (a FileNotFoundError still)
                if isinstance(exc, ArtifactNotFoundError):
                    raise
                raise ArtifactNotFoundError(
                    f"no compiled model at {source!r}: {exc.strerror}"
                ) from None
            if raw_plan is None:
                raise InvalidOptionError(
                    f"{source!r} is a compiled graph, not a compiled model: load it with "
                    "CompiledArtifact.load (load_model takes what CompiledModel.save wrote)"
                )
            check_compatible(manifest.environment, f"artifact {source!r}")
            artifact = CompiledArtifact(manifest, payloads)
        else:
            found = load_cached_model(cache, key)  # type: ignore[arg-type]
            if found is None:
                raise ArtifactNotFoundError(f"no intact model entry {key}", key=key)
            artifact, raw_plan = found
            where = f"the compiled model in cache entry {str(key)[:12]}"
        plan = ModelPlan.from_json(raw_plan, len(artifact.manifest.inputs))
        stale = stale_reason(plan)
        if stale is not None:
            raise IncompatibleArtifactError(f"{where} is stale: {stale}; compile again")
        check_identity(plan.identity, model, where)
        _check_rank(plan, where)
        compiled = CompiledModel(model, artifact, plan)
        if cudagraphs is not None:
            compiled.set_cudagraphs(cudagraphs)
        if warmup:
            compiled.warmup(background=warmup == "background")
        return compiled


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs")  # fmt: skip
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")


def hooks_on(model: torch.nn.Module) -> str | None:
    """A forward hook that calling ``model`` would run outside its forward (on the
    model itself, or registered for every module), which no trace of the forward holds."""
    if not (
        model._forward_hooks
        or model._forward_pre_hooks
        or _modules_of_torch._global_forward_hooks
        or _modules_of_torch._global_forward_pre_hooks
    ):
        return None  # the common case, per call: four dict truth tests
    for name in _MODULE_HOOKS:
        if getattr(model, name, None):
            return f"a {name.strip('_').replace('_', ' ').removesuffix('s')} on the model"
    for name in _GLOBAL_HOOKS:
        if getattr(_modules_of_torch, name, None):
            return f"a global {name.removeprefix('_global_').replace('_', ' ').removesuffix('s')}"
    return None


def _check_rank(plan: ModelPlan, where: str) -> None:
    """A plan traced under torch.distributed binds only on the rank, world size and
    backend it was traced on (its trace may hold the rank as a constant)."""
    here = this_rank()
    if plan.distributed is not None and plan.distributed != here:

        def said(value: tuple[int, int, str] | None) -> str:
            return (
                "outside torch.distributed"
                if value is None
                else (f"rank {value[0]} of {value[1]} ({value[2]})")
            )

        raise IncompatibleArtifactError(
            f"{where} was traced on {said(plan.distributed)}, this process runs "
            f"{said(here)}; a trace may hold its rank as a constant: load each rank's own "
            "compiled model (or let the cache find it)"
        )


_FLAT_LEAF_TYPES = (torch.Tensor, torch.nn.Parameter, bool, int, float, str, type(None))


def _flat_keywords(in_spec: Any) -> tuple[str, ...] | None:
    """The keyword names of a compiled call that is keyword-only with every argument a
    leaf (in flattening order), or None."""
    count = in_spec.num_leaves
    args, kwargs = adapter.tree_unflatten(list(range(count)), in_spec)
    if args or not isinstance(kwargs, dict) or list(kwargs.values()) != list(range(count)):
        return None
    return tuple(kwargs)


def _leaf_names(in_spec: Any) -> list[str]:
    """Per leaf of a call's (args, kwargs): the argument it belongs to ("input_ids",
    "argument 0")."""
    count = in_spec.num_leaves
    args, kwargs = adapter.tree_unflatten(list(range(count)), in_spec)
    names = [""] * count
    for position, value in enumerate(args):
        for leaf in adapter.tree_flatten(value, is_leaf=is_kv_cache)[0]:
            names[leaf] = f"argument {position}"
    for name, value in kwargs.items():
        for leaf in adapter.tree_flatten(value, is_leaf=is_kv_cache)[0]:
            names[leaf] = name
    return names


def load_model(
    model: torch.nn.Module, path: str | os.PathLike[str] | None = None, **options: Any
) -> CompiledModel:
    """``CompiledModel.load``: a saved compiled model bound to ``model``, no tracing."""
    return CompiledModel.load(model, path, **options)
