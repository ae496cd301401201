"""The example call ``compile_model`` traces, built once and passed whole.

A call's tensors, plain values and KV caches are found by flattening ``(args, kwargs)``;
each such leaf is then named by its top-level argument (a positional index or a keyword
name), which is how errors, ``dynamic=``, ``hints`` and ``sizes`` name it. Keeping the
call, its leaves and their arguments in one frozen value keeps the four in step: a
trace at lengths of 1 takes a copy with other leaves, never a list edited in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from precompile.runtime.compiler_interface import is_kv_cache, tree_flatten, tree_unflatten

# per argument (positional index or keyword name): its dynamic dims, as a list, or as a
# mapping of each dim to the sizes it takes (``_size_ranges``: (least, most) or None)
DynamicSpec = Mapping[int | str, Sequence[int] | Mapping[int, Any]] | None


def argument_name(path: Any) -> str:
    """An argument as a caller names it: ``argument 0`` or its keyword."""
    return f"argument {path}" if isinstance(path, int) else str(path)


def _leaf_paths(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """Each flattened leaf's top-level argument: positional index or keyword name, in the
    order pytree flattens ``(args, kwargs)`` (a dict in its own key order)."""
    paths: list[Any] = []
    _, spec = tree_flatten(dict(kwargs), is_leaf=is_kv_cache)
    for index, value in enumerate(args):
        paths += [index] * len(tree_flatten(value, is_leaf=is_kv_cache)[0])
    for name in spec.context if spec.context is not None else ():
        paths += [name] * len(tree_flatten(kwargs[name], is_leaf=is_kv_cache)[0])
    return tuple(paths)


# eq=False: two calls are the same call only by identity (comparing would compare tensors)
@dataclass(frozen=True, eq=False)
class ExampleCall:
    """``model(*args, **kwargs)`` as traced: the call, its flattened leaves (a KV cache is
    one leaf) and each leaf's argument (``paths``: positional index or keyword name)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: tuple[Any, ...]
    paths: tuple[Any, ...]

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Mapping[str, Any]) -> ExampleCall:
        """The call of ``args`` and ``kwargs`` (kwargs in the order given)."""
        args, kwargs = tuple(args), dict(kwargs)
        leaves, _ = tree_flatten((args, kwargs), is_leaf=is_kv_cache)
        return cls(args, kwargs, tuple(leaves), _leaf_paths(args, kwargs))

    def with_leaves(self, leaves: Sequence[Any]) -> ExampleCall:
        """The same call with other leaves in the same places (a narrowed copy, say)."""
        spec = tree_flatten((self.args, self.kwargs), is_leaf=is_kv_cache)[1]
        args, kwargs = tree_unflatten(list(leaves), spec)
        return ExampleCall(tuple(args), dict(kwargs), tuple(leaves), self.paths)

    def argument_name(self, leaf: int) -> str:
        """The argument leaf ``leaf`` belongs to, as a caller names it."""
        return argument_name(self.paths[leaf])

    def named_leaves(self) -> list[tuple[str, Any]]:
        """Each leaf with its argument's name (what ``CallerState`` watches)."""
        pairs = zip(self.paths, self.leaves, strict=True)
        return [(argument_name(path), leaf) for path, leaf in pairs]

    def kv_caches(self) -> dict[int, Any]:
        """The call's KV caches, by leaf index."""
        return {index: leaf for index, leaf in enumerate(self.leaves) if is_kv_cache(leaf)}


def with_distinct_tensors(
    call: ExampleCall, dynamic: DynamicSpec, hints: Any = None
) -> tuple[ExampleCall, DynamicSpec, Any]:
    """The example call with each tensor that fills more than one argument slot
    (``labels=input_ids``, the usual call of a causal LM's loss) copied into every slot
    after its first. Dynamo traces one tensor as one graph input, and the plan bound
    that input to one slot: the other was never read, so a later call with labels
    unlike its ids was answered from the labels alone (logits 0.56 off eager on a tiny
    Llama) or refused as ids (-100, transformers' ignore index, "outside the embedding's
    256 rows"). Each slot is now an input of its own; a call that passes one tensor in
    both slots is served too (the graph writes neither: the runtime refuses aliasing of
    an input the graph writes). A copy's argument gets the dynamic dims ``dynamic``
    names for the slot it was copied from, where ``dynamic`` names none of its own: the
    same tensor, so the same dims (with ``labels=input_ids``, ``dynamic={"input_ids":
    [1]}`` makes both lengths dynamic, as it did when they were one input), and likewise
    the per-dim ``hints`` keyed ``(argument, dim)`` (without them the copy's dim was
    compiled at the example's size, not the hint the caller gave its twin)."""
    leaves, paths = list(call.leaves), call.paths
    first: dict[int, int] = {}
    twins: list[tuple[int, int]] = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if id(leaf) in first:
            from ._torch_adapter import with_dynamo_marks

            copied = leaf.detach().clone(memory_format=torch.preserve_format)
            leaves[index] = with_dynamo_marks(leaf, copied.requires_grad_(leaf.requires_grad))
            twins.append((index, first[id(leaf)]))
        first.setdefault(id(leaf), index)
    if not twins:
        return call, dynamic, hints
    if isinstance(dynamic, Mapping):
        dynamic = dict(dynamic)
        for copy_index, original in twins:
            source, target = paths[original], paths[copy_index]
            if source in dynamic and target not in dynamic:
                dynamic[target] = dynamic[source]
    if isinstance(hints, Mapping):
        hints = dict(hints)
        for copy_index, original in twins:
            source, target = paths[original], paths[copy_index]
            for key, values in list(hints.items()):
                if isinstance(key, tuple) and len(key) == 2 and key[0] == source:
                    hints.setdefault((target, key[1]), values)
    return call.with_leaves(leaves), dynamic, hints
