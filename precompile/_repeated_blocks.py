"""Repeated blocks compiled once: a model's identical layers as one subgraph.

Inductor lowers, schedules and generates code for every node of the graph it is given,
so a compile's cost grows with a model's depth, and each variant pays it again. Dynamo's
graph of a transformer repeats one layer's nodes once per layer; here each run of them
becomes one call of torch's ``invoke_subgraph`` operator on a shared subgraph, which
AOTAutograd traces and inductor lowers and compiles once per variant, whatever the depth.

This is a rewrite of the graph Dynamo handed over, after the trace: Dynamo's guards are
those of the whole model (every layer's attributes are read and guarded, unlike with
``torch.compiler.nested_compile_region``, whose reuse checks run at trace time only),
and each call computes exactly what the nodes it replaces computed. A block is a module
that is one of two or more instances of its class under one container
(``model.layers.0``, ``model.layers.1``: Dynamo's ``nn_module_stack`` says which nodes
each one traced). Instances share a subgraph only where their nodes are identical: the
same operators in the same order on the same kinds of inputs, with equal constants (a
layer with another ``eps`` or window keeps a subgraph of its own). In-place writes (a KV
cache's ``index_copy_``) and random draws (dropout in training) stay in the outer graph
between the pieces of a block, and a piece whose output aliases its inputs is not
outlined, so no subgraph writes or aliases what it is given, and every draw happens once,
in the traced order. Anything not provably so stays as it was traced.

A piece's window runs from a layer's first matrix product to the next layer's, so what
ends one layer (its residual add) and begins the next (its norm) stay together and
inductor still fuses them. Off by default (``PRECOMPILE_REPEATED_BLOCKS=1`` turns it on):
the outlined code ran 3-5% slower per CUDA-graph replay on an H200 (the benchmarks page),
a cost not yet explained, which a default must not trade for build time silently.
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from precompile.cache import env_flag

from . import _torch_adapter as adapter
from ._random_policy import draws_random

log = logging.getLogger("precompile.compile")

# In every cache key: a build under another policy compiled other code.
POLICY = "blocks 1: identical runs of repeated modules' nodes as one invoke_subgraph"
SETTING = "PRECOMPILE_REPEATED_BLOCKS"
# A piece shorter than this is left inline: a call costs more than it saves.
MIN_PIECE_NODES = 4
_INDEXED = re.compile(r"^(?P<parent>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")
_CALLS = frozenset({"call_function", "call_method", "call_module"})
# What starts a window (see ``_windows``): matrix products, a fusion barrier for what
# feeds them.
_GEMMS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d",
                    "conv2d", "conv3d"})  # fmt: skip
_IN_PLACE_OPERATORS = frozenset(
    {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
     operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
)  # fmt: skip


def enabled() -> bool:
    """Whether repeated blocks are outlined (``PRECOMPILE_REPEATED_BLOCKS=1``; off by
    default: measured on an H200, the outlined Llama built 7% faster at 4 layers but ran
    3-5% slower per CUDA-graph replay, decode steps included)."""
    return env_flag(SETTING, False)


def policy() -> str:
    """This policy as a cache key's factor (a build under another compiled other code)."""
    return POLICY if enabled() else "blocks off"


@dataclass(frozen=True)
class BlockGroup:
    """One subgraph and the module instances whose pieces call it."""

    name: str
    module_class: str
    instances: tuple[str, ...]
    piece: int  # which piece of each instance (pieces are split at in-place writes)
    nodes: int  # nodes in the subgraph


@dataclass(frozen=True)
class Outlined:
    """The graph to compile (the caller's is never changed) and what was outlined."""

    gm: torch.fx.GraphModule
    groups: tuple[BlockGroup, ...]

    def summary(self) -> str:
        if not self.groups:
            return "no repeated blocks"
        return "; ".join(
            f"{g.name}: {len(g.instances)} x {g.nodes} nodes of {g.module_class.rsplit('.', 1)[-1]}"
            for g in self.groups
        )


def _instances(nodes: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, tuple[str, str]]:
    """Per call node, the outermost repeated module instance it was traced inside."""
    stacks = {n: adapter.module_stack(n) for n in nodes if n.op in _CALLS}
    siblings: dict[tuple[str, str], set[str]] = {}
    for stack in stacks.values():
        for path, kind in stack:
            match = _INDEXED.match(path)
            if match:
                siblings.setdefault((match["parent"], kind), set()).add(path)
    owner: dict[torch.fx.Node, tuple[str, str]] = {}
    for node, stack in stacks.items():
        for path, kind in stack:
            match = _INDEXED.match(path)
            if match and len(siblings[(match["parent"], kind)]) >= 2:
                owner[node] = (path, kind)
                break
    return owner


def _writes(node: torch.fx.Node) -> bool:
    """Whether a traced node may write a tensor in place (conservatively: any in-place
    method or function name, item assignment, in-place operators, ``out=``, a mutable
    operator schema, or a module call)."""
    if node.op == "call_module":
        return True
    if "out" in node.kwargs or node.kwargs.get("inplace") is True:
        return True
    target = node.target
    if getattr(target, "__module__", None) == "torch.nn.functional" and _inplace_arg(node):
        return True
    if node.op == "call_method":
        name = str(target)
    else:
        if target in _IN_PLACE_OPERATORS:
            return True
        schema = getattr(target, "_schema", None)
        if schema is not None and getattr(schema, "is_mutable", False):
            return True
        name = str(getattr(target, "__name__", ""))
    return name.endswith("_") and not name.endswith("__")


def _inplace_arg(node: torch.fx.Node) -> bool:
    """Whether a ``torch.nn.functional`` call passes ``inplace=True`` positionally."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True  # unreadable: assume it writes
    return bound.arguments.get("inplace") is True


def _pieces(nodes: Sequence[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """An instance's nodes in runs between in-place writes and random draws (which stay
    outside)."""
    runs: list[list[torch.fx.Node]] = [[]]
    for node in nodes:
        if _writes(node) or draws_random(node):
            runs.append([])
        else:
            runs[-1].append(node)
    return runs


def _constant(value: Any, refs: Callable[[torch.fx.Node], Any]) -> Any:
    """A node argument as a comparable value: nodes by their place, constants by type
    and value (floats bit-exact), anything else by identity."""
    if isinstance(value, torch.fx.Node):
        return refs(value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_constant(v, refs) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _constant(v, refs)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", *(_constant(v, refs) for v in (value.start, value.stop, value.step)))
    if isinstance(value, float):
        return ("float", value.hex())
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value).__name__, value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("torch", str(value))
    if value is Ellipsis:
        return ("...",)
    return ("object", id(value))


def _value_kind(value: Any) -> Any:
    """What a piece's input is, for comparing pieces: a tensor's dtype, device, sizes,
    strides and grad flag (symbolic sizes as expressions), a SymInt's expression."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor", str(value.dtype), str(value.device), value.requires_grad,
            tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()),
        )  # fmt: skip
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", type(value).__name__, str(value))
    return ("value", type(value).__name__, repr(value))


@dataclass
class _Piece:
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    outputs: list[int]  # positions in ``nodes`` used after the piece
    signature: Any


def _describe(nodes: list[torch.fx.Node], position: Any) -> _Piece | None:
    """A run of nodes as a piece (None where it cannot be one: an input defined after its
    first node, an output or input that is no value, or an output that aliases an input
    or another output)."""
    inside = {node: i for i, node in enumerate(nodes)}
    inputs: list[torch.fx.Node] = []
    place: dict[torch.fx.Node, int] = {}

    def refs(node: torch.fx.Node) -> Any:
        if node in inside:
            return ("node", inside[node])
        if node not in place:
            place[node] = len(inputs)
            inputs.append(node)
        return ("input", place[node])

    rows = []
    for node in nodes:
        args = _constant(node.args, refs)
        kwargs = _constant(dict(node.kwargs), refs)
        rows.append((node.op, node.target, args, kwargs))
    outputs = [i for i, node in enumerate(nodes) if any(u not in inside for u in node.users)]
    if not outputs or any(position[n] > position[nodes[0]] for n in inputs):
        return None
    values = [adapter.example_value(n) for n in inputs]
    results = [adapter.example_value(nodes[i]) for i in outputs]
    if any(not isinstance(v, torch.Tensor) for v in results):
        return None
    if any(v is None for v in values):
        return None
    storages = [adapter.storage_of(v) for v in values if isinstance(v, torch.Tensor)]
    seen = set(storages)
    for value in results:
        storage = adapter.storage_of(value)
        if storage in seen:
            return None  # an output aliasing an input or another output
        seen.add(storage)
    signature = (tuple(rows), tuple(_value_kind(v) for v in values))
    return _Piece(nodes, inputs, outputs, signature)


def _subgraph(
    piece: _Piece, outputs: Sequence[int], root: torch.nn.Module,
    replaced: Mapping[torch.fx.Node, torch.fx.Node],
) -> torch.fx.GraphModule:  # fmt: skip
    """The subgraph of ``piece``: its inputs as placeholders (``replaced``: what stands
    for an input that an earlier piece's call replaced), its nodes, its outputs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for index, node in enumerate(piece.inputs):
        placeholder = graph.placeholder(f"arg{index}")
        placeholder.meta.update(node.meta)
        env[node] = placeholder
        if node in replaced:
            env[replaced[node]] = placeholder
    for node in piece.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[piece.nodes[i]] for i in outputs))
    return torch.fx.GraphModule(root, graph)


def _replace(
    gm: torch.fx.GraphModule, piece: _Piece, outputs: Sequence[int], holder: torch.fx.Node,
    identifier: str, replaced: dict[torch.fx.Node, torch.fx.Node],
) -> None:  # fmt: skip
    """Replace ``piece``'s nodes by one call of the subgraph; ``replaced`` maps nodes of
    pieces replaced before (which this piece may read) to what stands for them now."""
    graph = gm.graph
    first = piece.nodes[0]
    inputs = [replaced.get(node, node) for node in piece.inputs]
    with graph.inserting_before(first):
        call = graph.call_function(adapter.invoke_subgraph_op(), (holder, identifier, *inputs))
        call.meta["example_value"] = tuple(adapter.example_value(piece.nodes[i]) for i in outputs)
        call.meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
        results = {}
        for slot, index in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, slot))
            item.meta.update(piece.nodes[index].meta)
            results[index] = item
            replaced[piece.nodes[index]] = item
    inside = set(piece.nodes)
    for index, item in results.items():
        node = piece.nodes[index]
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for node in reversed(piece.nodes):
        graph.erase_node(node)


_Candidate = tuple[str, str, int, "_Piece"]  # instance path, class, piece number, piece


def _groups(pieces: Iterable[_Candidate]) -> list[list[_Candidate]]:
    """Pieces of one class, number and signature, where two or more share them."""
    found: dict[Any, list[_Candidate]] = {}
    for entry in pieces:
        _, kind, number, piece = entry
        found.setdefault((kind, number, piece.signature), []).append(entry)
    return [group for group in found.values() if len(group) >= 2]


# What ``outline`` did to each graph it was given, for the cache entry's description.
_DONE: weakref.WeakKeyDictionary[torch.fx.GraphModule, str] = weakref.WeakKeyDictionary()


class _Recording(threading.local):
    found: list[str] | None = None


_recording = _Recording()


def summary_of(gm: torch.fx.GraphModule) -> str | None:
    """What ``outline`` shared in ``gm`` (``"4 x LlamaDecoderLayer (60 nodes)"``), where it
    shared anything."""
    return _DONE.get(gm)


@contextmanager
def recording() -> Iterator[list[str]]:
    """A list that gets what ``outline`` shares in each graph this thread compiles for the
    duration (a whole model's traces, for its cache entry's description)."""
    outer, _recording.found = _recording.found, []
    try:
        yield _recording.found
    finally:
        _recording.found = outer


def outline(gm: torch.fx.GraphModule) -> Outlined:
    """A copy of ``gm`` whose repeated blocks call shared subgraphs (see the module
    docstring); ``gm`` itself is not changed. Where nothing repeats, the copy is ``gm``'s
    graph as it was."""
    outlined = _outline(gm)
    if outlined.groups:
        _DONE[gm] = text = "; ".join(
            f"{len(g.instances)} x {g.module_class.rsplit('.', 1)[-1]} ({g.nodes} nodes)"
            for g in outlined.groups
        )
        if _recording.found is not None and text not in _recording.found:
            _recording.found.append(text)
    return outlined


def _contiguous(
    members: Sequence[torch.fx.Node], nodes: Sequence[torch.fx.Node], position: Any
) -> bool:
    """Whether no other call node sits between an instance's first and last node."""
    span = nodes[position[members[0]] : position[members[-1]] + 1]
    return sum(1 for n in span if n.op in _CALLS) == len(members)


def _is_gemm(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target) in _GEMMS
    if node.op == "call_function":
        return node.target is operator.matmul or getattr(node.target, "__name__", "") in _GEMMS
    return False


def _windows(
    instances: Sequence[Sequence[torch.fx.Node]],
    nodes: Sequence[torch.fx.Node],
    position: Any,
    owner: Any,
) -> list[list[torch.fx.Node]]:
    """Each instance's window: from its first GEMM up to the next instance's first GEMM
    (the last: up to the graph's next GEMM, a model's head), so that what ends one layer
    (the residual add) and begins the next (its norm) stay in one window and inductor
    still fuses them. Where an instance has no GEMM, or a window would reach into a
    module of another repeated class, each instance's own nodes are its window."""
    firsts = [next((position[n] for n in members if _is_gemm(n)), None) for members in instances]
    if any(first is None for first in firsts):
        return [list(members) for members in instances]
    ends = [*firsts[1:]]
    after = position[instances[-1][-1]] + 1
    ends.append(next((i for i in range(after, len(nodes)) if _is_gemm(nodes[i])), after))
    allowed = {owner[m[0]] for m in instances} | {None}
    windows = []
    for start, end in zip(firsts, ends, strict=True):
        window = [n for n in nodes[start:end] if n.op in _CALLS]  # type: ignore[misc]
        if any(owner.get(n) not in allowed for n in window):
            return [list(members) for members in instances]
        windows.append(window)
    if len(windows) >= 2:
        # The last window runs on into the model's own code (a final norm, then a slice of
        # the hidden states before the head): as long as the others at most, the rest of it
        # stays inline; whether it matches them is the pieces' signatures' to say.
        windows[-1] = windows[-1][: len(windows[-2])]
    return windows


def _outline(gm: torch.fx.GraphModule) -> Outlined:
    if not enabled():
        return Outlined(gm, ())
    owners = _instances(list(gm.graph.nodes))
    if not owners:
        return Outlined(gm, ())
    copied = copy.deepcopy(gm)
    mapping = dict(zip(gm.graph.nodes, copied.graph.nodes, strict=True))
    nodes = list(copied.graph.nodes)
    owner = {mapping[n]: who for n, who in owners.items()}
    by_instance: dict[tuple[str, str], list[torch.fx.Node]] = {}
    for node in nodes:
        if node in owner:
            by_instance.setdefault(owner[node], []).append(node)
    position = {node: i for i, node in enumerate(nodes)}
    siblings: dict[tuple[str, str], list[str]] = {}
    for path, kind in by_instance:
        match = _INDEXED.match(path)
        siblings.setdefault((match["parent"] if match else path, kind), []).append(path)
    candidates: list[_Candidate] = []
    for (_, kind), paths in siblings.items():
        instances = [by_instance[(path, kind)] for path in paths]
        if not all(_contiguous(members, nodes, position) for members in instances):
            log.debug("a repeated block of %s is not contiguous in the graph: left inline", kind)
            continue
        windows = _windows(instances, nodes, position, owner)
        for path, window in zip(paths, windows, strict=True):
            for number, run in enumerate(_pieces(window)):
                if len(run) < MIN_PIECE_NODES:
                    continue
                piece = _describe(run, position)
                if piece is not None:
                    candidates.append((path, kind, number, piece))
    groups: list[BlockGroup] = []
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    for members in _groups(candidates):
        union = sorted({i for *_, piece in members for i in piece.outputs})
        name = f"precompile_block_{len(groups)}"
        template = members[0][3]
        copied.add_submodule(name, _subgraph(template, union, copied, replaced))
        first_call = next(n for n in copied.graph.nodes if n.op in _CALLS | {"output"})
        with copied.graph.inserting_before(first_call):
            holder = copied.graph.get_attr(name)
        for *_, piece in members:
            _replace(copied, piece, union, holder, name, replaced)
        groups.append(
            BlockGroup(
                name, members[0][1], tuple(path for path, *_ in members), members[0][2],
                len(template.nodes),
            )
        )  # fmt: skip
    if not groups:
        return Outlined(gm, ())
    copied.graph.lint()
    copied.recompile()
    outlined = Outlined(copied, tuple(groups))
    log.info("repeated blocks compiled once: %s", outlined.summary())
    return outlined
