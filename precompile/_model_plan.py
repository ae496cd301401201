"""The plan of a traced call: how a later call maps onto the compiled graph.

Dynamo hands the backend the real parameters, buffers, argument tensors and KV cache
tensors, so each graph input is found by identity: a leaf of the call, a parameter or
buffer by name, a KV cache tensor by layer and field, or a size read from an argument's
dim. The plan (``ModelPlan``) records that, with how the output is rebuilt, so a later
process runs the graph with no trace.
"""

from __future__ import annotations

import inspect
import logging
import re
import types
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from precompile.runtime import UnsupportedGraphError
from precompile.runtime.compiler_interface import (
    NO_FILE,
    KVCacheLayout,
    ModelPlan,
    UnboundTensor,
    class_path,
    code_digest,
    describe_kv_cache,
    file_digest,
    fileless_functions,
    is_kv_cache,
    kv_cache_kind,
    kv_cache_tensors,
    model_identity,
    this_rank,
    tree_flatten,
    treespec_to_json,
)

from ._example_call import ExampleCall
from ._trace_read import trace_read

log = logging.getLogger("precompile.compile")


def _token_source(
    model: torch.nn.Module, call: ExampleCall, advanced: Mapping[int, list[int]]
) -> tuple[int, int] | None:
    """Where a call's token count (what it writes into each KV cache) is read: the last
    dim of ``input_ids`` or dim 1 of ``inputs_embeds``, checked against what the traced
    call advanced every KV cache layer by."""
    if not advanced:
        return None
    deltas = {d for layers in advanced.values() for d in layers}
    try:
        positional = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        positional = []
    for index, leaf in enumerate(call.leaves):
        path = call.paths[index]
        name = positional[path] if isinstance(path, int) and path < len(positional) else path
        if not isinstance(leaf, torch.Tensor) or leaf.dim() < 2:
            continue
        dim = {"input_ids": leaf.dim() - 1, "inputs_embeds": 1}.get(str(name))
        if dim is not None and deltas == {int(leaf.shape[dim])}:
            return index, dim
    raise UnsupportedGraphError(
        f"the traced call advanced its KV cache layers by {sorted(deltas)} tokens, which is "
        "not the token count of an input_ids or inputs_embeds argument; compile_model "
        "cannot tell how many tokens a call writes, so it cannot keep it within the cache"
    )


def build_plan(
    model: torch.nn.Module,
    call: ExampleCall,
    trace: Any,
    advanced: Mapping[int, list[int]],
    dims: Mapping[int, Collection[int]],
) -> ModelPlan:
    """How the traced ``call`` maps onto the graph: found by identity, since Dynamo hands
    the backend the real parameters, buffers, argument tensors and KV cache tensors.
    ``advanced``: by how many tokens the traced call advanced each KV cache's layers;
    ``dims``: the call's dynamic dims per leaf."""
    leaves = call.leaves
    names: dict[int, tuple[str, Any]] = {}
    for name, tensor in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(tensor), ("buffer", name))
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), ("parameter", name))
    kv_caches: dict[int, KVCacheLayout] = {}
    for index, leaf in enumerate(leaves):
        if is_kv_cache(leaf):
            kv_caches[index] = describe_kv_cache(leaf, call.argument_name(index))
            for layer, field, tensor in kv_cache_tensors(leaf):
                names[id(tensor)] = ("cache", (index, layer, field))
    leaf_of = {id(leaf): i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    manifest = trace.artifact.manifest
    bindings: list[tuple[str, Any]] = []
    for index, value in enumerate(trace.example_inputs):
        if isinstance(value, torch.Tensor):
            if id(value) in leaf_of:
                bindings.append(("leaf", leaf_of[id(value)]))
            elif id(value) in names:
                bindings.append(names[id(value)])
            else:
                raise UnsupportedGraphError(
                    f"graph input {index} ({trace.placeholder_names[index]}) is neither an "
                    "argument of the call nor a parameter or buffer of the model; compile_model "
                    "cannot feed it in a later process"
                )
        else:
            bindings.append(("size", None))
    for index, (kind, _) in enumerate(bindings):
        if kind == "size":
            bindings[index] = ("size", _size_source(manifest, index, bindings, model, call))
    for leaf in kv_caches:
        bound = {(t[1], t[2]) for kind, t in bindings if kind == "cache" and t[0] == leaf}
        missing = [(layer, f) for layer in range(len(kv_caches[leaf].layer_classes))
                   for f in kv_cache_kind(call.leaves[leaf]).rows
                   if (layer, f) not in bound]  # fmt: skip
        if missing:
            raise UnsupportedGraphError(
                f"the graph does not take the cache tensors {missing[:3]} of "
                f"{call.argument_name(leaf)} as inputs; compile_model serves caches whose "
                "every layer the model reads and writes"
            )
    constants: dict[int, Any] = {}
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) or index in kv_caches:
            continue
        if not isinstance(leaf, (bool, int, float, str, type(None))):
            raise UnsupportedGraphError(
                f"argument leaf {index} is a {type(leaf).__name__}; compile_model takes tensors, "
                "plain values (bool, int, float, str, None) and a transformers StaticCache as "
                "arguments"
            )
        constants[index] = leaf
    if trace.size_outputs:
        raise UnsupportedGraphError(
            f"the forward returns a value computed from a dynamic size (graph outputs "
            f"{list(trace.size_outputs)[:4]}: x.shape[0], x.size(0) * 2 or x.shape, say); "
            "compile_model rebuilds plain values as traced, so it would not "
            "follow the call's sizes: return it as a tensor, or compute it from the inputs' "
            "shapes outside the model"
        )
    out_leaves, out_spec = tree_flatten(trace.result, is_leaf=is_kv_cache)
    produced = {id(t): i for i, t in enumerate(trace.graph_outputs) if isinstance(t, torch.Tensor)}
    passed = {id(leaves[i]): i for i in kv_caches}
    outputs: list[tuple[str, Any]] = []
    for index, leaf in enumerate(out_leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf) in produced:
            outputs.append(("graph", produced[id(leaf)]))
        elif id(leaf) in passed:
            outputs.append(("cache", passed[id(leaf)]))
        elif isinstance(leaf, (bool, int, float, str, type(None))):
            outputs.append(("constant", leaf))
        elif isinstance(leaf, torch.Tensor) and (id(leaf) in leaf_of or id(leaf) in names):
            what = "an argument" if id(leaf) in leaf_of else f"the model's {names[id(leaf)][0]}"
            raise UnsupportedGraphError(
                f"output leaf {index} is {what} returned as it is ({type(leaf).__name__}), "
                "which the graph does not compute; compile_model rebuilds outputs the graph "
                "computes, plain values and the KV caches it was passed: return a result "
                "computed from it (x.clone(), say), or take it from your own call"
            )
        else:
            raise UnsupportedGraphError(
                f"output leaf {index} is a {type(leaf).__name__} that the graph does not "
                "return (a cache the model made itself: pass past_key_values=StaticCache("
                "config=model.config, max_cache_len=N), or use_cache=False); compile_model "
                "rebuilds outputs of tensors, plain values and the caches it was passed"
            )
    try:
        out_json = treespec_to_json(out_spec)
        in_json = treespec_to_json(tree_flatten(trace.call, is_leaf=is_kv_cache)[1])
    except (TypeError, NotImplementedError, ValueError) as exc:
        raise UnsupportedGraphError(
            f"the call's arguments or output have a structure torch cannot serialize ({exc})"
        ) from None
    position = next(
        (i for i, path in enumerate(call.paths)
         if path == "cache_position" and isinstance(leaves[i], torch.Tensor)),
        None,
    ) if kv_caches else None  # fmt: skip
    # a cache_position argument is checked against the tokens the call writes (its
    # length follows them, whichever dims the call made dynamic): not held to its trace
    unbound = {i: s for i, s in _unbound(leaves, bindings, dims).items() if i != position}
    files = {path: digest for path in sorted(trace.traced_files) if (digest := file_digest(path))}
    files.update(_fileless_places(trace.fileless_code, trace.kernel_fileless_code))
    return ModelPlan(
        model_class=class_path(model),
        in_spec=in_json,
        bindings=tuple(bindings),
        constants=constants,
        out_spec=out_json,
        outputs=tuple(outputs),
        traced_files=files,
        training=model.training,
        identity=model_identity(model),
        caches=kv_caches,
        tokens=_token_source(model, call, advanced),
        position_leaf=position,
        distributed=this_rank(),
        trace_read=trace_read(
            model, call.args, call.kwargs, trace.guards, trace.traced_code, trace.wrapper
        ),
        unbound=unbound,
    )


def _unbound(
    leaves: Sequence[Any], bindings: Sequence[tuple[str, Any]], dims: Mapping[int, Collection[int]]
) -> dict[int, UnboundTensor]:
    """The tensor leaves no graph input is bound to, as traced. A dynamic dim of one whose
    traced size a bound leaf's dynamic dim shares is tied to that dim: Dynamo gave the two
    one symbol (duck sizing) and guards them equal."""
    bound = [target for kind, target in bindings if kind == "leaf"]
    # a dim the graph takes as a size input of its own (``mask.shape[1]`` of a mask the
    # graph does not read) is read at each call: tied to itself, it may take any size
    read = {target for kind, target in bindings if kind == "size"}
    carriers: dict[int, tuple[int, int]] = {}
    for leaf in bound:
        for dim in sorted(dims.get(leaf, ())):
            carriers.setdefault(int(leaves[leaf].shape[dim]), (leaf, dim))
    found: dict[int, UnboundTensor] = {}
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or index in bound:
            continue
        tied = {
            dim: carriers[int(leaf.shape[dim])]
            for dim in dims.get(index, ())
            if int(leaf.shape[dim]) in carriers
        }
        tied.update({dim: (index, dim) for dim in range(leaf.dim()) if (index, dim) in read})
        found[index] = UnboundTensor.of(leaf, tied)
    return found


# Dynamo's name of a size read off an argument the graph does not take: a parameter of
# the forward (``L['mask'].size()[1]``) or a name in its ``**kwargs``
_ARGUMENT_SIZE = re.compile(
    r"^L\['(?:kwargs'\]\[')?(?P<name>[A-Za-z_]\w*)'\]\.size\(\)\[(?P<dim>\d+)\]$"
)


def _fileless_places(
    traced: Collection[types.CodeType], kernels: Collection[types.CodeType]
) -> dict[str, str]:
    """Code with no source file (``python -c``, a notebook cell) by the name a later
    process finds it under (``<no file: __main__.helper>``), with its digest. Traced code
    no module names (a generated ``__init__``) is not checked (docs/limits.md); a custom
    op's kernel no module names (one ``exec``'d from text) is recorded as unverifiable,
    so that only the compiling process uses the plan."""
    if not traced and not kernels:
        return {}
    names = {code: name for name, code in fileless_functions().items()}
    found = {}
    for code in {*traced, *kernels}:
        name = names.get(code)
        if name is not None:
            found[f"{NO_FILE}{name}>"] = code_digest(code)
        elif code in kernels:
            qualified = getattr(code, "co_qualname", code.co_name)
            found[f"{NO_FILE}{qualified} at {code.co_filename}, named by no module>"] = "0" * 64
            log.warning(
                "compile_model: a custom op's kernel %s has no source file and no module "
                "names it: a later process cannot check it, so it compiles again; define "
                "it in a .py file to reuse the build", qualified,
            )  # fmt: skip
        else:
            log.debug("traced code with no source file and no name to check it by: %s", code)
    return found


def _size_source(
    manifest: Any,
    index: int,
    bindings: Sequence[tuple[str, Any]],
    model: torch.nn.Module,
    call: ExampleCall,
) -> tuple[int, int]:
    """Where graph input ``index`` (a SymInt) is read from a call: a dim of an argument
    the graph takes, else of the argument Dynamo's name for it says (a tensor read only
    for its size: ``n = mask.shape[1]``)."""
    for symbol in manifest.symbols:
        if not any(s.input_index == index and s.dim is None for s in symbol.sources):
            continue
        for source in symbol.sources:
            if source.dim is not None and bindings[source.input_index][0] == "leaf":
                return bindings[source.input_index][1], source.dim
    name = manifest.inputs[index].name or ""
    match = _ARGUMENT_SIZE.match(name)
    path = _argument_path(model, call, match.group("name")) if match else None
    leaves = [i for i, p in enumerate(call.paths) if p == path and p is not None]
    if match and len(leaves) == 1 and isinstance(call.leaves[leaves[0]], torch.Tensor):
        dim = int(match.group("dim"))
        if dim < call.leaves[leaves[0]].dim():
            return leaves[0], dim
    raise UnsupportedGraphError(
        f"graph input {index} is a size ({name or 'unnamed'}) that no argument's dims "
        "carry; compile_model cannot compute it from a call: pass that size's tensor as "
        "an argument of its own, or read the size from a tensor the forward computes with"
    )


def _argument_path(model: torch.nn.Module, call: ExampleCall, parameter: str) -> Any:
    """The argument (positional index or keyword name) of ``call`` that the forward's
    ``parameter`` receives, or None."""
    if parameter in call.kwargs:
        return parameter
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    if parameter in positional and positional.index(parameter) < len(call.args):
        return positional.index(parameter)
    return None
