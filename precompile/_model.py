"""``precompile.compile_model``: a whole model as one compiled graph, found again in a
fresh process without tracing it.

The first process traces the model once with Dynamo (one full graph; a graph break is an
error naming the break), compiles the graph's variants, and records a plan: which graph
input is which parameter, buffer or argument, and how the output is rebuilt. A later
process computes the cache key from the model itself, with no tracing: its class and
the sources of its modules' classes, its config (and every submodule's settings), its
parameters' and buffers' names, shapes, dtypes and devices, the example call's
structure, the options and the environment. On a hit it checks the source files the
trace read are unchanged and runs the plan: no Dynamo frame, no compile, no compiler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cache import ArtifactCache, CacheOption, resolve_cache
from runtime import _torch_adapter as runtime_adapter
from runtime._cached import load_cached_model, store_model
from runtime._cudagraphs import CudaGraphsOption, cudagraph_options
from runtime._dtypes import dtype_name
from runtime._environment import current_environment
from runtime._errors import (
    CacheWriteError,
    IncompatibleArtifactError,
    InvalidOptionError,
    UnsupportedGraphError,
    UntrustedArtifactError,
)
from runtime._manifest import FORMAT_VERSION
from runtime._model import CompiledModel, ModelPlan, class_path, file_digest, stale_reason
from runtime._model_identity import canonical_digest as _digest
from runtime._model_identity import model_identity
from runtime._version import __version__

from ._offline import is_offline, refuse
from ._variant_plan import Hints, Sizes

log = logging.getLogger("precompile.compile")
DynamicSpec = Mapping[int | str, Sequence[int]] | None


def _dynamic_dims(
    leaves: Sequence[Any], spec_paths: Sequence[Any], dynamic: DynamicSpec, args_count: int
) -> dict[int, set[int]]:
    """Per tensor leaf, the dims to trace as dynamic: from ``dynamic`` (positional index or
    kwarg name -> dims) or from ``torch._dynamo.mark_dynamic`` on the example tensors."""
    dims: dict[int, set[int]] = {}
    for index, leaf in enumerate(leaves):
        marked = getattr(leaf, "_dynamo_dynamic_indices", None)
        if marked:
            dims[index] = set(marked)
    if dynamic is None:
        return dims
    if not isinstance(dynamic, Mapping):
        raise InvalidOptionError(
            f"dynamic must map an argument to its dynamic dims, got {dynamic!r}"
        )
    for key, wanted in dynamic.items():
        matches = [i for i, path in enumerate(spec_paths) if path == key]
        if not matches:
            raise InvalidOptionError(
                f"dynamic names argument {key!r}, which the example call does not have as a "
                "tensor (positional index or keyword name)"
            )
        leaf = leaves[matches[0]]
        for dim in wanted:
            if not isinstance(dim, int) or not 0 <= dim < leaf.dim():
                raise InvalidOptionError(f"dynamic dim {dim!r} of argument {key!r} is out of range")
        dims.setdefault(matches[0], set()).update(wanted)
    return dims


def _leaf_paths(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """Each flattened leaf's top-level argument: positional index or keyword name."""
    paths: list[Any] = []
    for index, value in enumerate(args):
        paths += [index] * len(runtime_adapter.tree_flatten(value)[0])
    for name in sorted(kwargs):  # pytree flattens a dict in key order
        paths += [name] * len(runtime_adapter.tree_flatten(kwargs[name])[0])
    return paths


def _codegen_config_digest() -> str:
    from . import _torch_adapter as adapter

    return adapter.codegen_config_digest()


def model_factors(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    dims: Mapping[int, set[int]],
    hints: Hints,
    sizes: Sizes,
    options: Mapping[str, Any],
) -> dict[str, str]:
    """The cache key's factors of a compiled model, all computed without tracing."""
    leaves, spec = runtime_adapter.tree_flatten((tuple(args), dict(kwargs)))
    described = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            shape = [
                ("dyn" if d in dims.get(index, ()) else int(s)) for d, s in enumerate(leaf.shape)
            ]
            described.append(["tensor", dtype_name(leaf.dtype), str(leaf.device), shape,
                              bool(leaf.requires_grad)])  # fmt: skip
        else:
            described.append(["value", repr(leaf)])
    device = next((str(t.device.type) for t in leaves if isinstance(t, torch.Tensor)), "cpu")
    environment = current_environment("cuda" if device == "cuda" else "cpu")
    return {
        **model_identity(model),  # model_class, model_sources, model_settings, model_tensors
        "model_mode": "train" if model.training else "eval",
        "call": _digest([str(spec), described]),
        "variants": _digest([hints, sizes]),
        "options": _digest(dict(options)),
        # inductor's config and the attention backends change the compiled code too
        "codegen_config": _codegen_config_digest(),
        "grad_mode": "enabled" if torch.is_grad_enabled() else "disabled",
        "torch": f"{environment.torch} ({environment.torch_git})",
        "triton": str(environment.triton),
        "python": environment.python,
        "device": f"{environment.device_type}:{environment.device_name}:{environment.capability}",
        "format": f"model plan 1, artifact {FORMAT_VERSION}, precompile {__version__}",
    }


def compile_model(
    model: torch.nn.Module,
    example_args: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic: DynamicSpec = None,
    hints: Hints = None,
    sizes: Sizes = None,
    options: Mapping[str, Any] | None = None,
    cache: CacheOption = None,
    cudagraphs: CudaGraphsOption = None,
    warmup: bool | str = "background",
    compile: bool = True,
) -> CompiledModel:
    """Compile ``model`` for calls shaped like ``model(*example_args, **example_kwargs)``.

    Dynamic dims: ``dynamic`` (``{0: [1]}``: positional argument 0's dim 1; keyword
    arguments by name) or ``torch._dynamo.mark_dynamic`` on the example tensors. Without
    ``sizes``, an exact-size variant with every dynamic dim at 1 is added (decode steps
    are served; Dynamo would trace size 1 apart). ``hints``, ``sizes``, ``options`` and
    ``cudagraphs`` as for ``standalone_compile``. ``cache``: a later process with the same
    model and call finds the compiled model there without tracing. ``warmup``: load every
    variant ("background" by default, so a new size never waits once warm-up is done).
    ``compile=False`` (or ``PRECOMPILE_OFFLINE=1``): a miss raises ``ArtifactNotFoundError``.
    """
    offline = is_offline(compile)
    if not isinstance(model, torch.nn.Module):
        raise InvalidOptionError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cudagraph_options(cudagraphs)  # validate early
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    leaves, _ = runtime_adapter.tree_flatten((args, kwargs))
    dims = _dynamic_dims(leaves, _leaf_paths(args, kwargs), dynamic, len(args))
    if dims and sizes is None:
        sizes = [1]
    store = resolve_cache(cache)
    factors = model_factors(model, args, kwargs, dims, hints, sizes, options or {})
    key = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()
    if store is not None:
        found = _cached_model(store, key, model)
        if found is not None:
            return _finish(found, cudagraphs, warmup)
        log.info("model cache miss: %s", store.explain_miss(key, factors))
    if offline:
        refuse(store, key, factors, None if store is None else _unused_because(store, key))
    if store is None:
        compiled = _trace_and_compile(model, args, kwargs, leaves, dims, hints, sizes, options)
        return _finish(compiled, cudagraphs, warmup)
    try:
        lock = store.lock(key)
        lock.__enter__()
    except CacheWriteError as exc:  # a read-only cache: no single flight, nothing stored
        log.warning("cache %s cannot take a lock (%s); compiling without storing", store.root, exc)
        compiled = _trace_and_compile(model, args, kwargs, leaves, dims, hints, sizes, options)
        return _finish(compiled, cudagraphs, warmup)
    try:
        found = _cached_model(store, key, model)  # built by another process meanwhile?
        if found is not None:
            return _finish(found, cudagraphs, warmup)
        compiled = _trace_and_compile(model, args, kwargs, leaves, dims, hints, sizes, options)
        compiled.cache_key = key
        try:
            store_model(store, key, compiled.artifact, compiled.plan.to_json(), factors)
        except CacheWriteError as exc:
            log.warning("compiled the model but could not store it: %s", exc)
    finally:
        lock.__exit__(None, None, None)
    return _finish(compiled, cudagraphs, warmup)


def _finish(
    compiled: CompiledModel, cudagraphs: CudaGraphsOption, warmup: bool | str
) -> CompiledModel:
    if cudagraphs is not None:
        compiled.artifact.set_cudagraphs(cudagraphs)
    if warmup:
        compiled.warmup(background=warmup == "background")
    return compiled


def _cached_model(store: ArtifactCache, key: str, model: torch.nn.Module) -> CompiledModel | None:
    try:
        found = load_cached_model(store, key)
    except UntrustedArtifactError as exc:
        log.warning("%s; compiling instead", exc)
        return None
    if found is None:
        return None
    artifact, raw_plan = found
    plan = ModelPlan.from_json(raw_plan, len(artifact.manifest.inputs))
    stale = stale_reason(plan)
    if stale is not None:
        log.info("model cache entry %s is stale: %s; compiling again", key[:12], stale)
        return None
    try:
        compiled = CompiledModel(model, artifact, plan)
    except IncompatibleArtifactError as exc:
        log.info("model cache entry %s does not fit this model (%s)", key[:12], exc)
        return None
    compiled.cache_key = key
    log.info("model cache hit %s: no tracing, no compile", key[:12])
    return compiled


def _unused_because(store: ArtifactCache, key: str) -> str | None:
    """Why the entry under ``key`` itself (if there is one) did not serve: what a miss
    names where the nearest entry is the key's own."""
    try:
        found = load_cached_model(store, key)
        if found is None:
            return None
        plan = ModelPlan.from_json(found[1], len(found[0].manifest.inputs))
    except (OSError, ValueError, RuntimeError) as exc:  # our errors subclass these
        return f"it cannot be read: {type(exc).__name__}: {exc}"
    stale = stale_reason(plan)
    return None if stale is None else f"it is stale: {stale}"


def _trace_and_compile(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: list[Any],
    dims: Mapping[int, set[int]],
    hints: Hints,
    sizes: Sizes,
    options: Mapping[str, Any] | None,
) -> CompiledModel:
    # The compile side (Dynamo, inductor, sympy) is imported only on a miss: a hit costs
    # none of it.
    from . import _torch_adapter as adapter
    from ._standalone import standalone_compile

    started = time.perf_counter()
    for index, wanted in dims.items():
        for dim in wanted:
            adapter.mark_dynamic(leaves[index], dim)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return standalone_compile(
            gm,
            example_inputs,
            dynamic_shapes="from_tracing_context",
            options=options,
            hints=hints,
            sizes=sizes,
            cache=False,
        )

    trace = adapter.trace_model(model, args, kwargs, compile_graph)
    plan = _plan(model, leaves, trace)
    log.info("traced and compiled %s in %.1f s", class_path(model), time.perf_counter() - started)
    return CompiledModel(model, trace.artifact, plan)


def _plan(model: torch.nn.Module, leaves: list[Any], trace: Any) -> ModelPlan:
    """How the traced call maps onto the graph: found by identity, since Dynamo hands the
    backend the real parameters, buffers and argument tensors."""
    names: dict[int, tuple[str, str]] = {}
    for name, tensor in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(tensor), ("buffer", name))
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), ("parameter", name))
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
            bindings[index] = ("size", _size_source(manifest, index, bindings))
    constants: dict[int, Any] = {}
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            continue
        if not isinstance(leaf, (bool, int, float, str, type(None))):
            raise UnsupportedGraphError(
                f"argument leaf {index} is a {type(leaf).__name__}; compile_model takes tensors "
                "and plain values (bool, int, float, str, None) as arguments"
            )
        constants[index] = leaf
    out_leaves, out_spec = runtime_adapter.tree_flatten(trace.result)
    produced = {id(t): i for i, t in enumerate(trace.graph_outputs) if isinstance(t, torch.Tensor)}
    outputs: list[tuple[str, Any]] = []
    for index, leaf in enumerate(out_leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf) in produced:
            outputs.append(("graph", produced[id(leaf)]))
        elif isinstance(leaf, (bool, int, float, str, type(None))):
            outputs.append(("constant", leaf))
        else:
            raise UnsupportedGraphError(
                f"output leaf {index} is a {type(leaf).__name__} that the graph does not "
                "return (a cache object, say: pass use_cache=False); compile_model rebuilds "
                "outputs of tensors and plain values"
            )
    try:
        out_json = runtime_adapter.treespec_to_json(out_spec)
        in_json = runtime_adapter.treespec_to_json(runtime_adapter.tree_flatten(trace.call)[1])
    except (TypeError, NotImplementedError, ValueError) as exc:
        raise UnsupportedGraphError(
            f"the call's arguments or output have a structure torch cannot serialize ({exc})"
        ) from None
    files = {path: digest for path in sorted(trace.traced_files) if (digest := file_digest(path))}
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
    )


def _size_source(manifest: Any, index: int, bindings: Sequence[tuple[str, Any]]) -> tuple[int, int]:
    """Where graph input ``index`` (a SymInt) is read from a call: a dim of an argument."""
    for symbol in manifest.symbols:
        if not any(s.input_index == index and s.dim is None for s in symbol.sources):
            continue
        for source in symbol.sources:
            if source.dim is not None and bindings[source.input_index][0] == "leaf":
                return bindings[source.input_index][1], source.dim
    raise UnsupportedGraphError(
        f"graph input {index} is a size that no argument's dims carry; compile_model cannot "
        "compute it from a call"
    )


def load_model(
    model: torch.nn.Module,
    path: str | os.PathLike[str] | None = None,
    **options: Any,
) -> CompiledModel:
    """A saved compiled model (``CompiledModel.save``) bound to ``model``; no tracing."""
    return CompiledModel.load(model, path, **options)
