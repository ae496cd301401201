"""KV caches in a model call: a ``transformers`` cache object taken apart into the
tensors a compiled graph reads and writes in place, checked before every call, and its
length tracked on the host.

**Kinds** (``KVCacheKind``): what this module knows of a cache kind, its layers' class
and the fields a graph takes, is one entry of ``KINDS``; the compile side asks the kind
(``kv_cache_kind``) instead of naming fields. ``StaticCache`` is the one kind served.

**Flattening** (the one order, documented in docs/decode.md): a ``StaticCache`` of N layers
is, per layer i, ``layers[i].keys`` and ``layers[i].values`` (``[batch, kv_heads,
max_cache_len, head_dim]``) and ``layers[i].cumulative_length`` (a 0-d int64 tensor: the
tokens the layer holds). The graph writes all three in place, as eager does: a call's
new keys and values at the positions ``cumulative_length`` says, then that count
advanced by the call's tokens. Only ``StaticLayer`` layers are taken: a ``DynamicCache``
replaces its tensors every call (they grow), and a sliding-window layer keeps its length
in a Python int a graph would be specialized to.

**Checked before a call runs**: the cache's class and each layer's class are the
compiled ones, the layer count, that the layers are initialized (a fresh cache is
initialized here with the compiled shapes, as eager initializes it on its first write),
that the call's tokens fit (each layer's length plus the tokens <= its max_cache_len:
never a write past the end), and that a ``cache_position`` argument, where the call has
one, is the positions those tokens take. Dtype, device, batch, head count, max_cache_len
and head dim are the artifact's input contract; a failure there is explained here in
the cache's terms.

**Lengths** live on the device, and reading them each call would synchronize the host
with the device every decode step. They are mirrored on the host: after a call the
mirror is advanced by the call's tokens and each counter's version remembered; any
in-place write torch sees (an eager step, ``reset()``) bumps a version, and a changed
version means the counters are read again (one synchronization).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._dtypes import dtype_name, dtype_of
from ._errors import CorruptArtifactError, InputMismatchError, UnsupportedGraphError
from ._manifest import TensorInput

STATIC_LAYER = "transformers.cache_utils.StaticLayer"
_IS_CACHE: dict[type, bool] = {}
_PATHS: dict[type, str] = {}


def class_path(value: Any) -> str:
    cls = type(value)
    path = _PATHS.get(cls)
    if path is None:  # once per class: a cache's kind is read per generate call
        path = _PATHS[cls] = f"{cls.__module__}.{cls.__qualname__}"
    return path


def kv_cache_capacities(cache: Any) -> tuple[int | None, ...]:
    """Each layer's ``max_cache_len`` (None where a layer says none): what a KV cache of
    any kind can hold, per layer."""
    layers = getattr(cache, "layers", None) or ()
    return tuple(getattr(layer, "max_cache_len", None) for layer in layers)


def kv_cache_capacity(cache: Any) -> int | None:
    """The tokens ``cache`` can hold: its layers' smallest ``max_cache_len`` (None where
    no layer says one)."""
    return min((n for n in kv_cache_capacities(cache) if isinstance(n, int)), default=None)


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a ``transformers`` cache object (a subclass of its ``Cache``),
    told without importing transformers."""
    cls = type(value)
    known = _IS_CACHE.get(cls)
    if known is None:
        known = any(
            c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in cls.__mro__
        )
        _IS_CACHE[cls] = known
    return known


@dataclass(frozen=True)
class CacheLayout:
    """The cache object a compiled call takes: its class and its layers' classes."""

    cache_class: str
    layer_classes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"class": self.cache_class, "layers": list(self.layer_classes)}

    @staticmethod
    def from_json(value: Any, where: str) -> CacheLayout:
        ok = isinstance(value, dict) and isinstance(value.get("class"), str)
        layers = value.get("layers") if ok else None
        if not (
            ok
            and len(value["class"]) < 4096
            and isinstance(layers, list)
            and 0 < len(layers) < 100_000
            and all(isinstance(name, str) and len(name) < 4096 for name in layers)
        ):
            raise CorruptArtifactError(f"{where} is not a cache layout")
        return CacheLayout(value["class"], tuple(layers))


@dataclass(frozen=True)
class KVCacheKind:
    """One kind of ``transformers`` KV cache as compiled calls take it: the one place
    that names its layers' fields. The compile side asks it (which tensors a graph
    takes, which of them have a batch, which counts tokens, a copy at batch 1); the
    runtime checks and tracks calls through the same names. A new kind is one more
    entry of ``KINDS``."""

    name: str
    layer_class: str  # every layer of the cache is of this class
    fields: tuple[str, ...]  # each layer's tensors a graph takes, in the flattening order
    rows: tuple[str, ...]  # those whose dim 0 is the batch
    counter: str  # the 0-d tensor counting the tokens a layer holds

    def matches(self, cache: Any) -> bool:
        layers = getattr(cache, "layers", None) or []
        return bool(layers) and all(class_path(layer) == self.layer_class for layer in layers)

    def tensors(self, cache: Any) -> list[tuple[int, str, torch.Tensor]]:
        """(layer, field, tensor) in the flattening order."""
        return [
            (index, field, getattr(layer, field))
            for index, layer in enumerate(cache.layers)
            for field in self.fields
        ]

    def counters(self, cache: Any) -> list[torch.Tensor]:
        return [getattr(layer, self.counter) for layer in cache.layers]

    def batch(self, cache: Any) -> int:
        """The batch its tensors hold (dim 0 of the first layer's first row field)."""
        return int(getattr(cache.layers[0], self.rows[0]).shape[0])

    def initialized(self, cache: Any) -> bool:
        """Whether every layer holds its tensors (a fresh cache makes them at its first
        write, shaped by it)."""
        return all(layer.is_initialized for layer in cache.layers)

    @staticmethod
    def place(argument: str, layer: int, field: str) -> str:
        """How a message names one of its tensors (``past_key_values.layers[0].keys``)."""
        return f"{argument}.layers[{layer}].{field}"

    def batch_of_one(
        self, cache: Any, mark: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> Any:
        """A copy of ``cache`` whose layers hold the first row of its row fields and a copy
        of its counter, each new tensor passed through ``mark(original, new)`` (which marks
        it as the original is marked); ``cache`` itself is never written."""
        narrowed = copy.copy(cache)
        narrowed.layers = []
        for layer in cache.layers:
            row = copy.copy(layer)
            for field in self.rows:
                original = getattr(layer, field)
                setattr(row, field, mark(original, original[:1].clone()))
            counter = getattr(layer, self.counter)
            setattr(row, self.counter, mark(counter, counter.clone()))
            if hasattr(row, "batch_size"):
                row.batch_size = 1
            narrowed.layers.append(row)
        return narrowed


# Not a kind yet: StaticSlidingWindowLayer (Mistral, Gemma2/3). Its length is a Python int
# (``cumulative_length_int``) its update branches on and moves in Python. Measured
# (torch 2.13, transformers 5.24): with ``torch.compiler.config.dynamic_sources`` naming
# that int, Dynamo takes it as a SymInt graph input and guards exactly the branch taken
# (``<= max_cache_len - 1`` for a decode step; ``== 0`` for a prefill, whose mask code
# branches on it), and replays the ``+=`` itself. Serving it needs an int input bound to
# the layer, its guards checked per call, the ``+=`` replayed by the runtime, and a trace
# of its own at 0 (as lengths at 1 have).
STATIC_CACHE = KVCacheKind(
    name="StaticCache",
    layer_class=STATIC_LAYER,
    fields=("keys", "values", "cumulative_length"),
    rows=("keys", "values"),
    counter="cumulative_length",
)
KINDS = (STATIC_CACHE,)
CACHE_FIELDS = tuple(dict.fromkeys(f for kind in KINDS for f in kind.fields))


def kv_cache_kind(cache: Any, name: str = "the KV cache") -> KVCacheKind:
    """The kind of ``cache``; ``UnsupportedGraphError`` for one no graph can take, saying
    why (``name``: the argument it is)."""
    for kind in KINDS:
        if kind.matches(cache):
            return kind
    layers = list(getattr(cache, "layers", None) or [])
    kinds = sorted({type(layer).__name__ for layer in layers})
    raise UnsupportedGraphError(
        f"{name} is a {type(cache).__name__} (layers: {', '.join(kinds) or 'none'}); "
        "compile_model takes a transformers StaticCache whose layers are all StaticLayer "
        "(StaticCache(config=model.config, max_cache_len=N)): a DynamicCache replaces its "
        "tensors every call, and a sliding-window layer keeps its length in a Python int "
        "that a graph would be specialized to"
    )


def describe_cache(cache: Any, name: str, *, initialized: bool = True) -> CacheLayout:
    """The layout of a cache a model is compiled with; ``UnsupportedGraphError`` for a
    cache whose tensors a graph cannot take as inputs (``initialized=False``: its layers'
    tensors, which a fresh cache does not have yet, are not looked at)."""
    kind = kv_cache_kind(cache, name)
    for index, layer in enumerate(cache.layers if initialized else ()):
        for field in kind.fields:
            if not isinstance(getattr(layer, field, None), torch.Tensor):
                raise UnsupportedGraphError(
                    f"{name} layer {index} has no tensor {field!r}; it cannot be a graph input"
                )
    return CacheLayout(class_path(cache), tuple(class_path(layer) for layer in cache.layers))


def cache_tensors(cache: Any) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, field, tensor) in the flattening order of the cache's kind; a cache of no
    kind (one a compile refuses, or a stand-in with the fields) is read by StaticCache's
    fields, as it is."""
    kind = next((k for k in KINDS if k.matches(cache)), STATIC_CACHE)
    return kind.tensors(cache)


def counter_values(counters: Sequence[torch.Tensor]) -> list[int]:
    """The counters' values, read with one synchronization where they share a device."""
    try:
        return [int(v) for v in torch.stack([c.reshape(()) for c in counters]).tolist()]
    except (RuntimeError, TypeError):
        return [int(c) for c in counters]


def _versions(counters: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    try:
        return tuple(c._version for c in counters)
    except RuntimeError:  # inference tensors keep no version counter: always read
        return None


@dataclass
class _Mirror:
    counters: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class CacheSlot:
    """One cache argument of a compiled call: where it is among the call's leaves, its
    layout, and per layer the compiled specs of its keys and values."""

    leaf: int
    name: str
    layout: CacheLayout
    keys: tuple[TensorInput, ...]
    values: tuple[TensorInput, ...]


class CacheGuard:
    """The checks and host-side length mirror of a compiled call's cache arguments."""

    def __init__(
        self,
        slots: Sequence[CacheSlot],
        tokens: Callable[[list[Any]], int],
        batch: Callable[[list[Any]], int],
        position_leaf: int | None,
    ) -> None:
        self.slots = tuple(slots)
        self._tokens = tokens
        self._batch = batch
        self._position_leaf = position_leaf
        self._mirrors: weakref.WeakKeyDictionary[Any, _Mirror] = weakref.WeakKeyDictionary()
        self._accepted: set[tuple[type, type]] = set()

    def before(self, leaves: list[Any]) -> int:
        """Check the caches of a call (initializing fresh ones); returns its token count."""
        tokens = self._tokens(leaves)
        for slot in self.slots:
            cache = leaves[slot.leaf]
            layers = self._check_structure(slot, cache)
            if not all(layer.is_initialized for layer in layers):
                self._initialize(slot, layers, leaves)
            lengths = self._lengths(slot, cache, layers)
            for index, (layer, length) in enumerate(zip(layers, lengths, strict=True)):
                capacity = int(layer.keys.shape[2]) if layer.keys.dim() == 4 else -1
                if length < 0 or length + tokens > capacity:
                    raise InputMismatchError(
                        f"{slot.name} layer {index} holds {length} tokens of max_cache_len "
                        f"{capacity}, and this call writes {tokens} more: past the cache's "
                        "end; reset() the cache or use a longer one",
                        input_name=slot.name,
                        expected=capacity,
                        got=length + tokens,
                    )
            if self._position_leaf is not None:
                self._check_positions(leaves[self._position_leaf], lengths, tokens, slot.name)
        return tokens

    def held(self, cache: Any) -> int:
        """The most tokens a layer of ``cache`` holds (0 for one not yet initialized): from
        the host mirror where it is current, else one read, which then serves the next
        call's check."""
        slot = self.slots[0]
        layers = self._check_structure(slot, cache)
        if not all(layer.is_initialized for layer in layers):
            return 0
        return max(self._lengths(slot, cache, layers), default=0)

    def after(self, leaves: list[Any], tokens: int) -> None:
        """The call ran: advance each cache's mirror by its tokens."""
        for slot in self.slots:
            cache = leaves[slot.leaf]
            mirror = self._mirrors.get(cache)
            if mirror is None:
                continue
            versions = _versions(mirror.counters)
            if versions is None:
                del self._mirrors[cache]
                continue
            mirror.versions = versions
            mirror.lengths = tuple(length + tokens for length in mirror.lengths)

    def forget(self, leaves: list[Any]) -> None:
        """A call failed part way: read the caches' lengths again next time."""
        for slot in self.slots:
            self.drop(leaves[slot.leaf])

    def drop(self, cache: Any) -> None:
        """``cache`` was written where the mirror did not see it (graph replays): read
        its lengths again next time."""
        self._mirrors.pop(cache, None)

    # -- checks ------------------------------------------------------------------------
    def _check_structure(self, slot: CacheSlot, cache: Any) -> list[Any]:
        layout = slot.layout
        if not is_kv_cache(cache):
            raise InputMismatchError(
                f"{slot.name} is a {type(cache).__name__}, but the model was compiled for a "
                f"{layout.cache_class.rpartition('.')[2]}",
                input_name=slot.name,
                expected=layout.cache_class.rpartition(".")[2],
                got=type(cache).__name__,
            )
        layers = getattr(cache, "layers", None)
        if not isinstance(layers, list) or len(layers) != len(layout.layer_classes):
            count = len(layers) if isinstance(layers, list) else "no"
            raise InputMismatchError(
                f"{slot.name} has {count} layers, but the model was compiled for a cache of "
                f"{len(layout.layer_classes)}",
                input_name=slot.name,
                expected=len(layout.layer_classes),
                got=len(layers) if isinstance(layers, list) else None,
            )
        for index, layer in enumerate(layers):
            pair = (type(cache), type(layer))
            if pair in self._accepted:
                continue
            if class_path(cache) != layout.cache_class:
                raise InputMismatchError(
                    f"{slot.name} is a {type(cache).__name__}, but the model was compiled for "
                    f"a {layout.cache_class.rpartition('.')[2]}; pass a cache of that class "
                    "(a dynamic cache cannot be served where a static one was compiled)",
                    input_name=slot.name,
                    expected=layout.cache_class.rpartition(".")[2],
                    got=type(cache).__name__,
                )
            if class_path(layer) != layout.layer_classes[index]:
                raise InputMismatchError(
                    f"{slot.name} layer {index} is a {type(layer).__name__}, but the model was "
                    f"compiled for a {layout.layer_classes[index].rpartition('.')[2]}",
                    input_name=f"{slot.name}.layers[{index}]",
                    expected=layout.layer_classes[index].rpartition(".")[2],
                    got=type(layer).__name__,
                )
            self._accepted.add(pair)
        return layers

    def initialized_copies(self, leaves: list[Any]) -> list[Any]:
        """``leaves`` with each fresh cache replaced by a copy initialized as a call would
        initialize it, for ``explain``: the caller's cache stays as it is (a call's first
        write initializes it; a question about the call does not)."""
        fresh = [
            slot
            for slot in self.slots
            if not all(
                layer.is_initialized for layer in self._check_structure(slot, leaves[slot.leaf])
            )
        ]
        if not fresh:
            return leaves
        copied = list(leaves)
        for slot in fresh:
            copied[slot.leaf] = copy.deepcopy(leaves[slot.leaf])
            self._initialize(slot, list(copied[slot.leaf].layers), copied)
        return copied

    def _initialize(self, slot: CacheSlot, layers: list[Any], leaves: list[Any]) -> None:
        """Initialize a fresh cache's layers with the compiled shapes, as eager does on its
        first write (zeros, length 0; the layer marks its tensors' addresses static)."""
        batch = self._batch(leaves)
        for layer, keys, values in zip(layers, slot.keys, slot.values, strict=True):
            if layer.is_initialized:
                continue
            device = torch.device(keys.device)
            key_dim, value_dim = keys.shape[3], values.shape[3]
            heads = keys.shape[1]
            if not all(isinstance(n, int) for n in (key_dim, value_dim, heads)):
                raise InputMismatchError(
                    f"{slot.name} is not initialized, and its compiled shape is not static "
                    "beyond the batch: initialize it (cache.early_initialization) first",
                    input_name=slot.name,
                )
            shape_k = (batch, heads, 0, key_dim)
            shape_v = (batch, heads, 0, value_dim)
            layer.lazy_initialization(
                torch.zeros(shape_k, dtype=dtype_of(keys.dtype), device=device),
                torch.zeros(shape_v, dtype=dtype_of(values.dtype), device=device),
            )

    def _lengths(self, slot: CacheSlot, cache: Any, layers: list[Any]) -> tuple[int, ...]:
        counters = tuple(layer.cumulative_length for layer in layers)
        mirror = self._mirrors.get(cache)
        if (
            mirror is not None
            and all(a is b for a, b in zip(mirror.counters, counters, strict=True))
            and _versions(counters) == mirror.versions
        ):
            return mirror.lengths
        for index, (layer, counter) in enumerate(zip(layers, counters, strict=True)):
            device = torch.device(slot.keys[index].device)
            for field, tensor in (("keys", layer.keys), ("cumulative_length", counter)):
                if not isinstance(tensor, torch.Tensor) or tensor.device != device:
                    where = tensor.device if isinstance(tensor, torch.Tensor) else "no tensor"
                    raise InputMismatchError(
                        f"{slot.name} layer {index} {field} is on device {where}, but the model "
                        f"was compiled for {device}",
                        input_name=KVCacheKind.place(slot.name, index, field),
                        expected=str(device),
                        got=str(where),
                    )
        lengths = tuple(counter_values(counters))
        versions = _versions(counters)
        if versions is not None:
            self._mirrors[cache] = _Mirror(counters, versions, lengths)
        else:
            self._mirrors.pop(cache, None)
        return lengths

    @staticmethod
    def _check_positions(positions: Any, lengths: Sequence[int], tokens: int, name: str) -> None:
        if positions is None:
            return
        if len(set(lengths)) != 1:
            raise InputMismatchError(
                f"cache_position is given, but the layers of {name} hold different lengths "
                f"{sorted(set(lengths))}; no one position fits them all",
                input_name="cache_position",
            )
        start = lengths[0]
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            got = type(positions).__name__
            if isinstance(positions, torch.Tensor):
                got += f" of shape {tuple(positions.shape)}"
            raise InputMismatchError(
                f"cache_position must be a 1-d tensor of {tokens} positions, got {got}",
                input_name="cache_position",
                expected="1-d tensor",
                got=got,
            )
        expected = torch.arange(start, start + tokens, device=positions.device)
        if positions.numel() != tokens or not torch.equal(positions.to(expected.dtype), expected):
            shown = positions.tolist() if positions.numel() <= 8 else f"{positions.numel()} values"
            raise InputMismatchError(
                f"cache_position is {shown}, but {name} holds {start} tokens, so this call's "
                f"{tokens} tokens take positions {start}..{start + tokens - 1}",
                input_name="cache_position",
                expected=list(range(start, start + tokens)),
                got=positions.tolist(),
            )

    # -- explaining a contract failure -----------------------------------------------
    def explain(self, leaves: list[Any]) -> str | None:
        """How a call's cache differs from the compiled one (dtype, device, batch, heads,
        max_cache_len, head dim), or None where it does not."""
        for slot in self.slots:
            cache = leaves[slot.leaf]
            layers = getattr(cache, "layers", None) or []
            for index, layer in enumerate(layers):
                for field, spec in (("keys", slot.keys[index]), ("values", slot.values[index])):
                    tensor = getattr(layer, field, None)
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    why = _difference(tensor, spec)
                    if why:
                        return f"{slot.name} layer {index} {field}: {why}"
            keys = getattr(layers[0], "keys", None) if layers else None
            try:
                batch = self._batch(leaves)
            except (AttributeError, IndexError, TypeError):
                continue
            if isinstance(keys, torch.Tensor) and keys.dim() and int(keys.shape[0]) != batch:
                return (
                    f"{slot.name} has batch size {int(keys.shape[0])}, but this call's batch is "
                    f"{batch}: a cache holds one sequence per row of the call"
                )
        return None


_AXES = ("batch size", "kv head count", "max_cache_len", "head dim")


def _difference(tensor: torch.Tensor, spec: TensorInput) -> str | None:
    if dtype_name(tensor.dtype) != spec.dtype:
        return f"dtype {dtype_name(tensor.dtype)}, but the model was compiled for {spec.dtype}"
    if torch.device(spec.device) != tensor.device:
        return f"device {tensor.device}, but the model was compiled for {spec.device}"
    if tensor.dim() != len(spec.shape):
        return f"shape {tuple(tensor.shape)}, but the model was compiled for rank {len(spec.shape)}"
    for axis, (size, want) in enumerate(zip(tensor.shape, spec.shape, strict=True)):
        if isinstance(want, int) and int(size) != want:
            what = _AXES[axis] if axis < len(_AXES) else f"dim {axis}"
            return f"{what} {int(size)}, but the model was compiled for {want}"
    return None


def slot_specs(
    bindings: Sequence[tuple[str, Any]], inputs: Sequence[Any], leaf: int, layers: int
) -> tuple[tuple[TensorInput, ...], tuple[TensorInput, ...]]:
    """Per layer, the compiled specs of a cache leaf's keys and values."""
    found: dict[tuple[int, str], TensorInput] = {}
    for (kind, target), spec in zip(bindings, inputs, strict=True):
        if kind == "cache" and target[0] == leaf and isinstance(spec, TensorInput):
            found[(target[1], target[2])] = spec
    try:
        keys = tuple(found[(layer, "keys")] for layer in range(layers))
        values = tuple(found[(layer, "values")] for layer in range(layers))
    except KeyError as missing:
        raise CorruptArtifactError(f"model plan binds no cache tensor {missing}") from None
    return keys, values


def parse_cache_binding(target: Any) -> tuple[int, int, str] | None:
    """A ``["cache", [leaf, layer, field]]`` binding's target, or None if malformed."""
    if (
        isinstance(target, list)
        and len(target) == 3
        and type(target[0]) is int
        and type(target[1]) is int
        and target[0] >= 0
        and target[1] >= 0
        and target[2] in CACHE_FIELDS
    ):
        return target[0], target[1], target[2]
    return None


def caches_from_json(value: Any, where: str) -> dict[int, CacheLayout]:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise CorruptArtifactError(f"{where} field caches is malformed")
    found: dict[int, CacheLayout] = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int):
            raise CorruptArtifactError(f"{where} field caches is malformed")
        found[pair[0]] = CacheLayout.from_json(pair[1], f"{where} cache {pair[0]}")
    return found


def layouts_to_json(caches: Mapping[int, CacheLayout]) -> list[Any]:
    return [[leaf, layout.to_json()] for leaf, layout in sorted(caches.items())]
