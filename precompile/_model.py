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

import contextlib
import dataclasses
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch

from precompile.cache import ArtifactCache, CacheOption, get_or_build, resolve_cache
from precompile.runtime import (
    CompiledModel,
    IncompatibleArtifactError,
    InputMismatchError,
    InvalidOptionError,
    UnsupportedGraphError,
    UntrustedArtifactError,
)
from precompile.runtime.compiler_interface import (
    ABOUT_BLOCKS,
    ABOUT_CONFIG,
    CudaGraphsOption,
    Dispatcher,
    KVCacheLayout,
    ModelPlan,
    TensorInput,
    class_path,
    cudagraph_options,
    describe_kv_cache,
    dtype_name,
    hooks_on,
    is_kv_cache,
    kv_cache_capacity,
    kv_cache_counter_values,
    kv_cache_kind,
    kv_cache_tensors,
    load_cached_model,
    store_model,
    synthesize_inputs,
    this_rank,
)
from precompile.runtime.compiler_interface import plan_stale_reason as stale_reason

from ._caller_state import CallerState
from ._environment_reads import reads_environment
from ._example_call import DynamicSpec, ExampleCall, argument_name, with_distinct_tensors
from ._model_plan import build_plan
from ._offline import is_offline, refuse
from ._random_policy import inductors_random_numbers
from ._size_ranges import SizeRange, check_within, parse_range
from ._variant_plan import Hints, Sizes, check_kinds

log = logging.getLogger("precompile.compile")


def _dynamic_dims(call: ExampleCall, dynamic: DynamicSpec) -> dict[int, set[int]]:
    """Per tensor leaf, the dims to trace as dynamic: from ``dynamic`` (positional index or
    kwarg name -> dims) or from ``torch._dynamo.mark_dynamic`` on the example tensors. An
    argument holding several tensors (a dict of masks, one per layer type, as transformers'
    ``generate`` passes for Qwen2) has those dims dynamic in each of them: marking only
    its first left the others' sizes fixed, and the trace specialized the call to them."""
    from . import _torch_adapter as adapter  # lazily, as below: a warm lookup needs little

    leaves, spec_paths = call.leaves, call.paths
    dims: dict[int, set[int]] = {}
    for index, leaf in enumerate(leaves):
        marked = adapter.marked_dynamic_dims(leaf)
        if marked:
            dims[index] = marked
    if dynamic is None:
        return dims
    if not isinstance(dynamic, Mapping):
        raise InvalidOptionError(
            f"dynamic must map an argument to its dynamic dims, got {dynamic!r}"
        )
    for key, wanted in dynamic.items():
        if isinstance(wanted, (str, bytes)) or not isinstance(wanted, (Sequence, Mapping)):
            raise InvalidOptionError(
                f"dynamic[{key!r}] must be a list of dims or a dict of dims to size ranges "
                f"((least, most)), got {wanted!r}"
            )
        for dim in wanted:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise InvalidOptionError(
                    f"dynamic[{key!r}] names dim {dim!r}: a dim is an int index"
                )
        matches = [
            i
            for i, path in enumerate(spec_paths)
            if path == key and (isinstance(leaves[i], torch.Tensor) or is_kv_cache(leaves[i]))
        ]
        if not matches:
            raise InvalidOptionError(
                f"dynamic names argument {key!r}, which the example call does not have as a "
                "tensor (positional index or keyword name)"
            )
        if is_kv_cache(leaves[matches[0]]):
            if any(dim != 0 for dim in wanted):
                raise InvalidOptionError(
                    f"dynamic dims {list(wanted)} of cache argument {key!r}: only its batch "
                    "(dim 0 of its keys and values) can be dynamic"
                )
            dims.setdefault(matches[0], set()).update(wanted)
            continue
        for index in matches:
            leaf = leaves[index]
            if not isinstance(leaf, torch.Tensor):
                continue  # a KV cache beside tensors in one argument: not a dim of it
            for dim in wanted:
                if not isinstance(dim, int) or not 0 <= dim < leaf.dim():
                    raise InvalidOptionError(
                        f"dynamic dim {dim!r} of argument {key!r} is out of range"
                    )
                if int(leaf.shape[dim]) < 2:
                    raise InvalidOptionError(
                        f"dynamic dim {dim} of argument {key!r} is {int(leaf.shape[dim])} in "
                        "the example call; Dynamo specializes sizes 0 and 1, so the dim would "
                        "not be dynamic: give an example of at least 2 there"
                    )
            dims.setdefault(index, set()).update(wanted)
    return dims


def _declared_ranges(call: ExampleCall, dynamic: DynamicSpec) -> dict[tuple[int, int], SizeRange]:
    """The size ranges ``dynamic`` declares (an argument's dims mapped to ``(least,
    most)``), per (leaf, dim); dims left at the default range are not listed."""
    found: dict[tuple[int, int], SizeRange] = {}
    if not isinstance(dynamic, Mapping):
        return found
    for key, wanted in dynamic.items():
        if not isinstance(wanted, Mapping):
            continue
        for dim, value in wanted.items():
            size_range = parse_range(value, f"{argument_name(key)} dim {dim}")
            if size_range.default:
                continue
            for index, path in enumerate(call.paths):
                leaf = call.leaves[index]
                if path == key and (isinstance(leaf, torch.Tensor) or is_kv_cache(leaf)):
                    found[(index, dim)] = size_range
    return found


def _check_ranges(
    call: ExampleCall,
    dims: Mapping[int, set[int]],
    ranges: Mapping[tuple[int, int], SizeRange],
    hints: Hints,
    sizes: Sizes,
) -> None:
    """Before any trace: per-dim hints name dynamic dims, at sizes of 1 and more, and the
    example, hints and sizes lie in the declared ranges."""
    for key, values in hints.items() if isinstance(hints, Mapping) else ():
        if not (isinstance(key, tuple) and len(key) == 2):
            continue  # symbol names: the graph's to check
        argument, dim = key
        if not any(path == argument and dim in dims.get(leaf, ()) for leaf, path in
                   enumerate(call.paths)):  # fmt: skip
            raise InvalidOptionError(
                f"hints name {key!r}, but dim {dim!r} of argument {argument!r} is not a "
                "dynamic dim of the call (dynamic= names those)"
            )
        bad = [v for v in (values if isinstance(values, Sequence) else ())
               if isinstance(v, int) and not isinstance(v, bool) and v < 1]  # fmt: skip
        if bad:
            raise InvalidOptionError(
                f"hints for {key!r} hold {bad[0]}: a hint is a size of 1 or more"
            )
    if not ranges:
        return
    names = {place: f"{call.argument_name(place[0])} dim {place[1]}" for place in ranges}
    example = {(leaf, dim): int(call.leaves[leaf].shape[dim]) for leaf, dim in ranges
               if isinstance(call.leaves[leaf], torch.Tensor)}  # fmt: skip
    key_of = {(leaf, dim): (call.paths[leaf], dim) for leaf, dim in ranges}
    check_within(ranges, names, example, hints, sizes, key_of)


def _kv_cache_batch_follows_call(call: ExampleCall, dims: dict[int, set[int]]) -> None:
    """A KV cache's batch (dim 0 of its keys and values) is dynamic when the batch of the
    call's tensors is: Dynamo would otherwise specialize the call's batch to its own."""
    leaves = call.leaves
    dynamic_batches = {
        int(leaves[i].shape[0])
        for i, wanted in dims.items()
        if isinstance(leaves[i], torch.Tensor) and 0 in wanted
    }
    for index, kv_cache in call.kv_caches().items():
        if index not in dims and kv_cache_kind(kv_cache).batch(kv_cache) in dynamic_batches:
            dims[index] = {0}


def _cuda_indices(values: Sequence[Any]) -> list[int]:
    """The CUDA devices of the tensors among ``values`` (and of the KV caches among them,
    their layers not yet allocated left out): whose generators a run that draws random
    numbers is forked on."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    for value in values:
        if is_kv_cache(value):
            tensors.extend(tensor for _, _, tensor in kv_cache_tensors(value))
    return sorted({t.device.index or 0 for t in tensors
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})  # fmt: skip


def _prepare_kv_caches(
    model: torch.nn.Module, call: ExampleCall, state: CallerState
) -> dict[int, KVCacheLayout]:
    """The example call's KV caches, initialized (a fresh StaticCache is initialized by
    running the model once eagerly, then emptied again: what its lazy initialization on a
    first write would leave; the rest of what that run wrote is put back), and their
    layouts; unsupported KV caches, and KV caches written under grad, are refused before
    anything runs. Their tensors are watched from then on."""
    kv_caches = call.kv_caches()
    if not kv_caches:
        _refuse_a_kv_cache_the_model_makes(model, call.kwargs)
        return {}
    for index, kv_cache in kv_caches.items():
        describe_kv_cache(kv_cache, call.argument_name(index), initialized=False)
    _refuse_a_kv_cache_of_another_batch(call)
    _refuse_grad_into_kv_caches(model, call)
    if not all(kv_cache_kind(c).initialized(c) for c in kv_caches.values()):
        log.info("initializing the example call's KV cache with one eager run")
        state.keep_all()
        try:  # its random draws (dropout in training) from forked generators
            with torch.no_grad(), torch.random.fork_rng(devices=_cuda_indices(call.leaves)):
                model(*call.args, **call.kwargs)
        finally:
            state.restore()
        for kv_cache in kv_caches.values():
            for _, _, tensor in kv_cache_tensors(kv_cache):
                tensor.zero_()
    for index, kv_cache in kv_caches.items():
        kind = kv_cache_kind(kv_cache)
        for layer, field, tensor in kind.tensors(kv_cache):
            state.watch(kind.place(call.argument_name(index), layer, field), tensor, "cache")
    return {i: describe_kv_cache(c, call.argument_name(i)) for i, c in kv_caches.items()}


# A config's sizes worth a glance, and their short names (transformers' attribute_map
# answers these names for configs that spell them otherwise, GPT-2's n_embd say).
_CONFIG_SIZES = {
    "num_hidden_layers": "layers",
    "hidden_size": "hidden",
    "num_attention_heads": "heads",
    "vocab_size": "vocab",
}


def config_summary(model: torch.nn.Module) -> str:
    """A model's config in short, for ``cache ls``: its ``model_type`` and main sizes
    (where it has a ``config``), its parameter count and dtypes. Not part of the key."""
    parts = []
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type:
        parts.append(model_type)
    for field, short in _CONFIG_SIZES.items():
        value = getattr(config, field, None)
        if type(value) is int:
            parts.append(f"{short}={value}")
    parameters = list(model.parameters())
    count = sum(p.numel() for p in parameters)
    dtypes = "/".join(sorted({dtype_name(p.dtype) for p in parameters}))
    scaled = next((f"{count / s:.1f}{u}" for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"))
                   if count >= s), str(count))  # fmt: skip
    parts.append(f"{scaled} params" + (f", {dtypes}" if dtypes else ""))
    return ", ".join(parts)


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
    arguments by name) or ``torch._dynamo.mark_dynamic`` on the example tensors. Lengths
    at 1 are traced apart, as Dynamo traces them, into the same compiled model (decode
    steps are served from a trace at 1; see ``_trace_with_pieces``); 0 is refused.
    ``dynamic={0: {1: (2, 4096)}}`` declares the sizes a dim takes (``(least, most)``,
    most None for no bound, or a ``torch.export.Dim``): a least of 2 or more is not traced
    at 1, and calls outside a range are refused by name (``NoVariantError``).
    ``hints``, ``sizes``, ``options`` and ``cudagraphs`` as for ``standalone_compile``.
    ``cache``: the artifact store, where a later process with the same model and call
    finds the compiled model without tracing. ``warmup``: load every variant
    ("background" by default, so a new size never waits once warm-up is done).
    ``compile=False`` (or ``PRECOMPILE_OFFLINE=1``): a miss raises ``ArtifactNotFoundError``.
    Compiling writes none of the caller's state: the model's parameters, buffers and
    attributes and the example's tensors are as they were (see ``_caller_state``).
    """
    offline = is_offline(compile)
    if not isinstance(model, torch.nn.Module):
        raise InvalidOptionError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cudagraph_options(cudagraphs)  # validate early
    check_kinds(hints, sizes)  # before tracing: inside Dynamo's backend it is wrapped
    hooked = hooks_on(model)
    if hooked:
        raise UnsupportedGraphError(
            f"{hooked} is registered: it runs outside the model's forward, which is what "
            "compile_model traces and compiles (a compiled model runs no hook of the model "
            "itself); register it on a submodule (traced into the graph), or apply it to "
            "the compiled model's inputs or outputs"
        )
    kwargs = dict(sorted((example_kwargs or {}).items()))  # a call's kwargs, sorted by name
    call = ExampleCall.of(example_args, kwargs)
    _refuse_unrecordable_values(call)
    call, dynamic, hints = with_distinct_tensors(call, dynamic, hints)
    with CallerState(model, call.named_leaves()) as state:
        compiled = _compiled_model(
            model, call, state,
            dynamic=dynamic, hints=hints, sizes=sizes, options=options, store_option=cache,
            offline=offline,
        )  # fmt: skip
    return _finish(compiled, cudagraphs, warmup)


def _builds_cpu_kernels(model: torch.nn.Module, call: ExampleCall) -> bool:
    """Whether a compile of this call will build C++ kernels: a CPU tensor among the
    call's leaves or the model's first parameter."""
    first = next(model.parameters(), None)
    tensors = [leaf for leaf in call.leaves if isinstance(leaf, torch.Tensor)]
    return any(t.device.type == "cpu" for t in (*tensors, *([first] if first is not None else [])))


def _compiled_model(
    model: torch.nn.Module,
    call: ExampleCall,
    state: CallerState,
    *,
    dynamic: DynamicSpec,
    hints: Hints,
    sizes: Sizes,
    options: Mapping[str, Any] | None,
    store_option: CacheOption,
    offline: bool,
) -> CompiledModel:
    """``compile_model`` up to its warm-up: found in the artifact store (``store_option``:
    the ``cache=`` it was given), or traced and compiled."""
    dims = _dynamic_dims(call, dynamic)
    ranges = _declared_ranges(call, dynamic)
    _check_ranges(call, dims, ranges, hints, sizes)
    kv_caches = _prepare_kv_caches(model, call, state)
    if kv_caches:
        _kv_cache_batch_follows_call(call, dims)
    store = resolve_cache(store_option)
    # the compile side's key module imports its adapter: not in a process that only loads
    from ._cache_key import cache_key, model_factors

    factors = model_factors(model, call.args, call.kwargs, dims, hints, sizes, options or {})
    if ranges:  # a compile with declared ranges has other guards, and maybe fewer traces
        factors["size_ranges"] = repr(sorted((p, r.least, r.most) for p, r in ranges.items()))
    key = cache_key(factors)

    blocks: list[str] = []

    def build(store: ArtifactCache | None) -> CompiledModel:
        from . import _vec_isa_probe as vec_isa_probe
        from ._repeated_blocks import recording

        if _builds_cpu_kernels(model, call):
            vec_isa_probe.start()  # overlaps the trace; joined before the first compile

        with recording() as found:
            compiled = _trace_with_pieces(
                model,
                call,
                dims,
                ranges,
                hints=hints,
                sizes=sizes,
                options=options,
                store=store,
                state=state,
            )
        blocks.extend(found)
        if store is not None:
            compiled.cache_key = key
        return compiled

    def save(store: ArtifactCache, compiled: CompiledModel) -> None:
        about = {ABOUT_CONFIG: config_summary(model)}
        if blocks:
            about[ABOUT_BLOCKS] = "; ".join(blocks)
        pieces = [piece.artifact for piece in compiled.pieces.values()]
        store_model(store, key, compiled.artifact, compiled.plan.to_json(), factors, about,
                    pieces)  # fmt: skip

    def refuse_offline() -> NoReturn:
        unused = None if store is None else _unused_because(store, key, model)
        refuse(store, key, factors, unused)

    return get_or_build(
        store, key, factors,
        load=lambda store: _model_in_store(store, key, model),
        build=build,
        save=save,
        refuse=refuse_offline if offline else None,
        what="model",
    )  # fmt: skip


def _refuse_a_kv_cache_the_model_makes(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Refuse, before tracing, a call of a transformers model that will make a KV cache
    itself (``use_cache`` on in its config, not turned off by the call, and no KV cache
    passed): its output holds a ``DynamicCache``, which the trace would find only at
    its end, after minutes of tracing a large model."""
    config = getattr(model, "config", None)
    forward = inspect.signature(model.forward).parameters
    # transformers names the KV cache argument past_key_values (``cache`` from version 5.2x)
    slots = [name for name in ("past_key_values", "cache") if name in forward]
    if "use_cache" not in forward or not slots:
        return
    wanted = kwargs.get("use_cache")
    if wanted is None:
        wanted = getattr(config, "use_cache", None)
    if wanted is True and all(kwargs.get(name) is None for name in slots):
        raise UnsupportedGraphError(
            f"this call of {type(model).__name__} makes a KV cache itself (use_cache is on "
            "in its config and the call passes no cache): a DynamicCache, which compile_model "
            f"cannot serve; pass use_cache=False, or {slots[0]}=StaticCache("
            "config=model.config, max_cache_len=N)"
        )


def _refuse_unrecordable_values(call: ExampleCall) -> None:
    """A plain argument is recorded in the plan (JSON) and checked against each call: a
    float that is not finite has no JSON number (it failed in the writer, a bare
    ``ValueError``) and a nan equals no call's. Refused by name before anything runs."""
    for index, leaf in enumerate(call.leaves):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            raise UnsupportedGraphError(
                f"argument {call.argument_name(index)!r} is {leaf}: a plain float argument is "
                "recorded and checked against each call, finite values only; pass it as a "
                "tensor (torch.tensor(...)) to compile the model for it"
            )


def _refuse_a_kv_cache_of_another_batch(call: ExampleCall) -> None:
    """A KV cache holds one sequence per row of the call: one of another batch (a cache
    made, or first written, at another batch; ``reset()`` keeps its batch) is refused by
    name before anything runs. Eager fails inside the model (``index_copy_``'s slice
    shapes); the trace failed in Dynamo."""
    ids = call.kwargs.get("input_ids", call.kwargs.get("inputs_embeds"))
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return
    batch = int(ids.shape[0])
    for index, kv_cache in call.kv_caches().items():
        kind = kv_cache_kind(kv_cache)
        if not kind.initialized(kv_cache) or kind.batch(kv_cache) == batch:
            continue
        name = call.argument_name(index)
        raise InputMismatchError(
            f"{name} holds a batch of {kind.batch(kv_cache)} (dim 0 of its keys), but the "
            f"call's batch is {batch}: a KV cache holds one sequence per row of the call "
            f"(reset() keeps its batch); pass one made for a batch of {batch}",
            input_name=name,
            expected=batch,
            got=kind.batch(kv_cache),
        )


def _refuse_grad_into_kv_caches(model: torch.nn.Module, call: ExampleCall) -> None:
    """Refuse, before anything runs, a call that writes a KV cache with grad enabled and
    parameters (or arguments) that require grad: each call writes the KV cache with
    values that require grad, so after one its tensors require grad, and the graph,
    compiled for them as they are before a call, cannot take the next one on it."""
    caches = [call.argument_name(i) for i in call.kv_caches()]  # KV caches, by name
    if not caches or not torch.is_grad_enabled():
        return
    parameters = any(p.requires_grad for p in model.parameters())
    if parameters or any(isinstance(t, torch.Tensor) and t.requires_grad for t in call.leaves):
        raise UnsupportedGraphError(
            f"the call writes the KV cache {caches[0]!r} with grad enabled: its tensors would "
            "require grad after a call (the written keys and values come from parameters "
            "that require grad), and a graph compiled for the cache before a call cannot "
            "take it after one; compile and call the model under torch.no_grad() (or "
            "model.requires_grad_(False))"
        )


def _finish(
    compiled: CompiledModel, cudagraphs: CudaGraphsOption, warmup: bool | str
) -> CompiledModel:
    if cudagraphs is not None:
        compiled.set_cudagraphs(cudagraphs, save=True)  # the compile's choice is the default
    if warmup:
        compiled.warmup(background=warmup == "background")
    return compiled


def _model_in_store(store: ArtifactCache, key: str, model: torch.nn.Module) -> CompiledModel | None:
    """The compiled model under ``key`` in the artifact store, where it is there, trusted,
    fresh and fits ``model``; None sends ``get_or_build`` on to compile."""
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


def _unused_because(store: ArtifactCache, key: str, model: torch.nn.Module) -> str | None:
    """Why the entry under ``key`` itself (if there is one) did not serve: what a miss
    names where the nearest entry is the key's own (a changed source file, or a model
    that differs from the compiled one in what its trace read, both unseen by the key)."""
    try:
        found = load_cached_model(store, key)
        if found is None:
            return None
        plan = ModelPlan.from_json(found[1], len(found[0].manifest.inputs))
    except (OSError, ValueError, RuntimeError) as exc:  # our errors subclass these
        return f"it cannot be read: {type(exc).__name__}: {exc}"
    stale = stale_reason(plan)
    if stale is not None:
        return f"it is stale: {stale}"
    try:
        CompiledModel(model, found[0], plan)
    except IncompatibleArtifactError as exc:
        return str(exc)
    return None


def _graph_ops_accept(gm: Any, flat: Sequence[Any], written: set[int]) -> None:
    """Run the traced graph's own operations (eager, on copies of the inputs it writes)
    before its compiled code first runs: where they refuse the inputs (an index out of
    range), compiled C++ kernels check the same bound inside a parallel region, where the
    failure ends the process (std::terminate) instead of raising. Seen on a trace at
    lengths at 1 that no call of the model's own makes (an attention mask's batch at 1
    beside input_ids' at 2): the trace is refused, its calls then NoVariantError."""
    inputs = [x.clone() if i in written and isinstance(x, torch.Tensor) else x
              for i, x in enumerate(flat)]  # fmt: skip
    try:  # random ops here draw from forked generators: the caller's state is untouched
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_indices(flat)):
            # node by node: a GraphModule's own call prints the failing code's traceback
            # to stderr before raising, and a refusal here is an answer, not a failure
            torch.fx.Interpreter(gm).run(*inputs)
    except (IndexError, RuntimeError, ValueError) as exc:
        # the error's own first line (the interpreter appends the node it ran, on more)
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UnsupportedGraphError(
            f"the traced graph's own operations refuse these inputs ({type(exc).__name__}: "
            f"{said}); its compiled code is not run on them"
        ) from None


# A compiled model's floating outputs differ from eager's by rounding: a relative error
# (norm of the difference over the norm of eager's) of 2e-7 on the tiny Llama's float32
# logits; bfloat16 keeps 8 bits (4e-3 per value), some layers of it add up to about 1e-2.
# Another dropout mask changes a share of the values by their own size: 0.64 on that
# Llama (attention dropout 0.3, a StaticCache), where compiled and eager drew apart.
DRAWN_APART = 3e-2


def _drawn_apart(expected: Any, actual: Any) -> bool:
    """Whether two outputs differ by more than rounding (floating tensors only)."""
    if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
        return False
    if not expected.is_floating_point() or expected.shape != actual.shape:
        return False
    want, got = expected.double(), actual.double()
    scale = float(want.norm())
    return scale > 0 and float((got - want).norm()) / scale > DRAWN_APART


def _draws_as_eager(
    model: torch.nn.Module, compiled: CompiledModel, call: ExampleCall, state: CallerState
) -> None:
    """A graph that draws random numbers is compiled to draw them as eager does (see
    ``_random_policy``), yet the model may still draw otherwise once compiled: its Python
    can choose other kernels while traced (a tiny Llama with attention dropout over a
    StaticCache: the traced attention took a dropout mask other than eager's), and a
    lowering can draw where eager does not (dropout at p=1). So the example call runs
    eagerly and compiled, from the same generator states (forked: the caller's stay where
    they were), what either writes put back: outputs that differ by more than rounding
    (``_drawn_apart``), or generators left in other states, refuse the model, naming why."""
    devices = _cuda_indices(call.leaves)

    def states() -> list[torch.Tensor]:
        return [torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in devices)]

    expected, eager_left = _run_eagerly(model, call, state, lambda run: (run(), states()))
    actual, compiled_left = _run_eagerly(
        model, call, state, lambda run: (compiled(*call.args, **call.kwargs), states())
    )
    leaves = torch.utils._pytree.tree_leaves
    pairs = zip(leaves(expected), leaves(actual), strict=False)
    if any(_drawn_apart(a, b) for a, b in pairs):
        why = "gives other outputs than eager from the same seed"
    elif not all(torch.equal(a, b) for a, b in zip(eager_left, compiled_left, strict=True)):
        why = "leaves the random generator elsewhere than eager does from the same seed"
    else:
        return
    raise UnsupportedGraphError(
        f"the model draws random numbers (dropout in training, torch.rand) and, compiled, "
        f"{why} (its compiled code draws them otherwise): serve it in eval() mode, or pass "
        "options={'config_patches': {'fallback_random': False}} to take inductor's own "
        "random numbers"
    )


def _variant_points_accepted(
    gm: Any, manifest: Any, flat: Sequence[Any], written: set[int], capacity: int | None
) -> None:
    """The warm-up runs every variant at its own point on made-up inputs; the traced
    graph's own operations run there first, as for the example. A point they refuse pairs
    sizes no call can have (a mask's batch, a symbol of its own left at the example's 2,
    beside 8 rows of input_ids at their hint): the compiled code would fail the same index
    check inside a parallel region, which ends the process. Refused here, naming them.
    With a KV cache, the warm-up runs no point beyond the cache (``capacity``): nor this."""
    for variant in manifest.variants:
        point = tuple(variant.point[name] for name in manifest.symbol_names)
        if capacity is not None and any(size > capacity for size in point):
            continue
        inputs = synthesize_inputs(manifest, point, list(flat))
        try:
            _graph_ops_accept(gm, inputs, written)
        except UnsupportedGraphError as exc:
            sizes = ", ".join(
                f"{_symbol_where(manifest, symbol)} = {variant.point[symbol.name]}"
                for symbol in manifest.symbols
            )
            raise UnsupportedGraphError(
                f"the variant at {sizes} has sizes the model's own operations refuse "
                f"({exc}): either a hint past what the model takes at all (a length past "
                "its position table: keep hints within it), or dims that must agree (a "
                "mask's batch and input_ids') given different hints: give them the same hints"
            ) from None


def _symbol_where(manifest: Any, symbol: Any) -> str:
    for source in symbol.sources:
        spec = manifest.inputs[source.input_index]
        if source.dim is not None:
            name = getattr(spec, "name", None) or f"input {source.input_index}"
            return f"{name} dim {source.dim}"
    return str(symbol.name)


def _trace_and_compile(
    model: torch.nn.Module,
    call: ExampleCall,
    dims: Mapping[int, set[int]],
    *,
    hints: Hints,
    sizes: Sizes,
    options: Mapping[str, Any] | None,
    store: ArtifactCache | None,
    state: CallerState,
) -> CompiledModel:
    """One trace of ``call`` with ``dims`` dynamic, its graph compiled and its plan made."""
    # The compile side (Dynamo, inductor, sympy) is imported only on a miss: a hit costs
    # none of it.
    from . import _torch_adapter as adapter
    from ._model_trace import trace_model
    from ._standalone import check_policy_switches, standalone_compile

    check_policy_switches(options)  # a bad fallback_random, say, is refused before the trace

    leaves = call.leaves
    started = time.perf_counter()
    to_mark: list[tuple[torch.Tensor, int]] = []
    for index, wanted in dims.items():
        for dim in wanted:
            if is_kv_cache(leaves[index]):
                kind = kv_cache_kind(leaves[index])
                to_mark += [(t, dim) for _, f, t in kind.tensors(leaves[index]) if f in kind.rows]
            else:
                to_mark.append((leaves[index], dim))
    # the caller's tensors get Dynamo's marks for this trace only: left on them, a later
    # trace of theirs (a compile_model naming no dynamic dim) was dynamic there too
    marks = contextlib.ExitStack()
    marks.enter_context(adapter.marks_put_back([t for t, _ in to_mark]))
    for tensor, dim in to_mark:
        adapter.maybe_mark_dynamic(tensor, dim)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        def by_input(value: Any) -> Any:
            return _graph_dims(value, example_inputs, call)

        return standalone_compile(
            gm,
            example_inputs,
            dynamic_shapes="from_tracing_context",
            options=options,
            hints=by_input(hints) if isinstance(hints, Mapping) else hints,
            sizes=[by_input(s) if isinstance(s, Mapping) else s for s in sizes]
            if sizes is not None
            else None,
            # Under torch.distributed, the graph is stored under its own key too (no rank
            # in it): of ranks tracing the same graph, one compiles and the others load
            # (the artifact store's lock per key). Otherwise the model's entry is the only
            # one.
            cache=store if store is not None and this_rank() is not None else False,
        )

    def keep_written(gm: Any, artifact: Any, flat: Sequence[Any]) -> None:
        # The traced run writes exactly the inputs its manifest says the graph writes.
        written = {i for i, spec in enumerate(artifact.manifest.inputs)
                   if isinstance(spec, TensorInput) and spec.mutation != "none"}  # fmt: skip
        if not artifact.manifest.process_groups:  # collectives run only where all ranks do
            started = time.perf_counter()
            _graph_ops_accept(gm, flat, written)
            _variant_points_accepted(gm, artifact.manifest, flat, written, capacity)
            log.info("the traced graph's own operations accept the variants' points "
                     "(%.1f s)", time.perf_counter() - started)  # fmt: skip
        state.keep(flat[i] for i in sorted(written))

    kv_caches = call.kv_caches()
    capacity = min(
        (n for c in kv_caches.values() if (n := kv_cache_capacity(c)) is not None), default=None
    )
    before = {i: kv_cache_counter_values(kv_cache_kind(c).counters(c))
              for i, c in kv_caches.items()}  # fmt: skip
    python_state = state.python_state(model)
    try:
        # the traced run draws (dropout in training) from forked generators
        with torch.random.fork_rng(devices=_cuda_indices(call.leaves)):
            trace = trace_model(model, call.args, call.kwargs, compile_graph, keep_written)
        written = state.written(python_state)
        if written:
            raise UnsupportedGraphError(
                f"the model's forward writes its Python state ({', '.join(written[:5])}): "
                "a compiled model runs none of the forward's Python, so its calls would not "
                "write it, and outputs that read it would differ from eager's; keep such "
                "state in buffers (a graph writes those), or outside the model"
            )
        advanced = {
            i: [b - a for a, b in zip(before[i], kv_cache_counter_values(
                kv_cache_kind(c).counters(c)), strict=True)]
            for i, c in kv_caches.items()
        }  # fmt: skip
    finally:
        # What the traced run wrote is put back before the plan records the model (its
        # identity reads the module's attributes, which the trace's Python may rebind).
        state.put_back(python_state)
        state.restore()
        marks.close()
    state.check()
    plan = build_plan(model, call, trace, advanced, dims)
    if reads_environment(trace.guards):
        plan = dataclasses.replace(
            plan, trace_read=_with_environment(model, call, state, plan.trace_read)
        )
    _check_dynamic(plan, trace.artifact.manifest, dims, call)
    log.info("traced and compiled %s in %.1f s", class_path(model), time.perf_counter() - started)
    compiled = CompiledModel(model, trace.artifact, plan, {})
    if trace.artifact.manifest.draws_random and not inductors_random_numbers(options):
        _draws_as_eager(model, compiled, call, state)
    return compiled


def _with_environment(
    model: torch.nn.Module, call: ExampleCall, state: CallerState, read: Any
) -> Any:
    """``read`` with a check of every environment variable the forward looks up, found
    by running it once more, eagerly (``_environment_reads``)."""
    from ._environment_reads import environment_guards

    found = _run_eagerly(model, call, state, environment_guards)
    known = {repr(g.to_json()) for g in read.guards}
    extra = tuple(g for g in found if repr(g.to_json()) not in known)
    return dataclasses.replace(read, guards=(*read.guards, *extra))


def _run_eagerly(
    model: torch.nn.Module,
    call: ExampleCall,
    state: CallerState,
    around: Callable[[Callable[[], Any]], Any] = lambda run: run(),
) -> Any:
    """``around(run)``, where ``run`` calls the model's forward on ``call``, eagerly. What
    it writes is put back (the module's Python state, the buffers and arguments ``state``
    watches, and the call's own tensors and KV caches, which may be copies the caller
    never saw), and its random draws come from forked generators."""
    tensors = []
    for leaf in call.leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif is_kv_cache(leaf):
            tensors.extend(tensor for _, _, tensor in kv_cache_tensors(leaf))
    python_state = state.python_state(model)
    state.keep_all()
    state.keep(tensors)
    try:
        with torch.random.fork_rng(devices=_cuda_indices(tensors)):
            return around(lambda: model(*call.args, **call.kwargs))
    finally:
        state.put_back(python_state)
        state.restore()


def _eager_refusal(model: torch.nn.Module, call: ExampleCall, state: CallerState) -> str | None:
    """Why the model's own forward refuses ``call``, or None. A trace at lengths of 1
    pairs sizes that no call of the model's may (an attention mask's batch at 1 beside
    input_ids' at 2): asked before it is traced, such a trace costs one eager forward
    instead of a trace and its compile."""
    try:
        with torch.no_grad():
            _run_eagerly(model, call, state)
    except (IndexError, RuntimeError, ValueError) as exc:
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        return f"the model's own forward refuses these inputs ({type(exc).__name__}: {said})"
    return None


def _trace_with_pieces(
    model: torch.nn.Module,
    call: ExampleCall,
    dims: Mapping[int, set[int]],
    ranges: Mapping[tuple[int, int], SizeRange],
    *,
    hints: Hints,
    sizes: Sizes,
    options: Mapping[str, Any] | None,
    store: ArtifactCache | None,
    state: CallerState,
) -> CompiledModel:
    """The model traced as Dynamo traces it: once with every dynamic length at 2 or more
    (the graph Dynamo assumes 0 and 1 away from: its variants are guarded to serve 2 and
    more only), and once more per combination of lengths at 1 (each a piece: its own
    trace, graph and plan, with the other lengths dynamic). A model whose Python branches
    on a length (``x * 2 if x.shape[0] > 1 else x * 3``) is so served each branch from a
    trace of it. Length 0 is refused (``NoVariantError``). A dynamic batch that a KV
    cache follows is traced at 1 with a copy of the KV cache narrowed to batch 1. A
    length whose declared range (``ranges``) starts at 2 or more is not traced at 1, and
    every graph is guarded to its lengths' declared ranges."""
    main = _past_the_ast_race(
        _trace_and_compile, model, call, dims, hints=hints, sizes=_at_least_two(sizes),
        options=options, store=store, state=state,
    )  # fmt: skip
    artifact, places, declared = _held_to_ranges(main, call, ranges)
    lengths = [length for length in _lengths(main, call.leaves)
               if declared.get(length[0], SizeRange()).least < 2]  # fmt: skip
    # each dim's range is its symbol's: a dim Dynamo found equal to a declared one (the
    # call's batch beside a KV cache's) is refused by name outside it too
    effective = {place: declared[name] for name, found in places.items() if name in declared
                 for place in found}  # fmt: skip
    plan = dataclasses.replace(main.plan, ranges=tuple(
        (leaf, dim, r.least, r.most) for (leaf, dim), r in sorted(effective.items())
    ))  # fmt: skip
    if not lengths:
        return CompiledModel(model, artifact, plan, {})
    for name, _, _ in lengths:
        artifact = artifact.excluding(f"{name} >= 2")
    count = len(lengths)
    corners = [frozenset(i for i in range(count) if mask >> i & 1) for mask in range(1, 1 << count)]
    if count > 3:  # 2^k traces: each length alone at 1, and all of them (the rest refused)
        corners = [frozenset({i}) for i in range(count)] + [frozenset(range(count))]
    pieces: dict[frozenset[int], CompiledModel] = {}
    for ones in corners:
        narrowed = list(call.leaves)
        at_one: set[tuple[int, int]] = set()
        for index in ones:
            for leaf, dim in lengths[index][1]:
                narrowed[leaf] = narrowed[leaf].narrow(dim, 0, 1).contiguous()
                at_one.add((leaf, dim))
            for leaf in lengths[index][2]:
                narrowed[leaf] = _batch_of_one(narrowed[leaf])
                at_one.add((leaf, 0))
        corner_dims = {leaf: {d for d in wanted if (leaf, d) not in at_one}
                       for leaf, wanted in dims.items()}  # fmt: skip
        corner = call.with_leaves(narrowed)
        said = ", ".join(f"{_where(call, lengths[i][1])} = 1" for i in sorted(ones))
        refusal = _eager_refusal(model, corner, state)
        if refusal is not None:
            log.info(
                "compile_model: not traced at %s: %s; calls with those lengths are refused "
                "(NoVariantError)", said, refusal,
            )  # fmt: skip
            continue
        try:
            piece = _past_the_ast_race(
                _trace_and_compile, model, corner,
                {leaf: d for leaf, d in corner_dims.items() if d},
                hints=_hints_besides(hints, call, at_one), sizes=[], options=options,
                store=store, state=state,
            )  # fmt: skip
        except Exception as exc:  # the model cannot be traced there: those calls refused
            log.warning(
                "compile_model: the model could not be traced at %s (%s: %s); calls with "
                "those lengths are refused (NoVariantError)", said, type(exc).__name__,
                str(exc)[:500],
            )  # fmt: skip
            continue
        piece_artifact = _held_to_ranges(piece, corner, ranges)[0]
        for name, _, _ in _lengths(piece, corner.leaves):
            piece_artifact = piece_artifact.excluding(f"{name} >= 2")
        pieces[ones] = CompiledModel(model, piece_artifact, piece.plan, {})
        log.info("compile_model: traced %s apart, as Dynamo would", said)
    plan = dataclasses.replace(
        plan,
        lengths=tuple(places[0] for _, places, _ in lengths),
        pieces=tuple(
            {"ones": sorted(ones), "manifest": p.artifact.manifest.to_json(),
             "plan": p.plan.to_json()}
            for ones, p in pieces.items()
        ),
    )  # fmt: skip
    return CompiledModel(model, artifact, plan, pieces)


# CPython before 3.13 keeps one AST-construction depth per interpreter, not per thread:
# two threads building ``ast`` trees at once (a trace's and, say, a background warm-up's
# or a user's) can fail either with this SystemError (python/cpython#106905). A trace
# changes nothing it does not put back, so it is simply made again.
_AST_RACE = "AST constructor recursion depth mismatch"
_AST_RACE_TRIES = 3


def _past_the_ast_race(
    trace: Callable[..., CompiledModel], *args: Any, **kwargs: Any
) -> CompiledModel:
    """``trace(*args, **kwargs)``, made again where CPython's AST race failed it."""
    for attempt in range(_AST_RACE_TRIES):
        try:
            return trace(*args, **kwargs)
        except Exception as exc:
            cause: BaseException | None = exc
            while cause is not None and not (
                isinstance(cause, SystemError) and _AST_RACE in str(cause)
            ):
                cause = cause.__cause__ or cause.__context__
            if cause is None and _AST_RACE not in str(exc):
                raise
            if attempt + 1 == _AST_RACE_TRIES:
                raise
            log.info("compile_model: CPython's AST race failed a trace (%s); tracing again",
                     _AST_RACE)  # fmt: skip
    raise AssertionError("unreachable")


def _lengths(
    compiled: CompiledModel, leaves: Sequence[Any]
) -> list[tuple[str, list[Any], list[int]]]:
    """The graph's dynamic lengths Dynamo traced at 2 or more, by symbol, each with the
    argument dims it is read at and the KV caches whose batch it is (a dynamic batch the
    KV cache follows: a trace at batch 1 takes a copy of it narrowed to batch 1). A
    symbol a KV cache reads otherwise than as its batch is not one."""
    places, elsewhere = _symbol_places(compiled, leaves)
    found = []
    for name, at in places.items():
        dims = [(leaf, dim) for leaf, dim in at if not is_kv_cache(leaves[leaf])]
        kv_caches = sorted(leaf for leaf, _ in at if is_kv_cache(leaves[leaf]))
        if (
            name not in elsewhere
            and dims
            and all(int(leaves[leaf].shape[dim]) >= 2 for leaf, dim in dims)
        ):
            found.append((name, dims, kv_caches))
    return found


def _symbol_places(
    compiled: CompiledModel, leaves: Sequence[Any]
) -> tuple[dict[str, list[tuple[int, int]]], set[str]]:
    """Per symbol of the compiled graph, the (leaf, dim) places a call's size is read at:
    argument dims (those the graph takes, and sizes it takes read off one), and a KV
    cache's batch as (its leaf, 0); and the symbols a KV cache also reads otherwise (a
    length of its own, not the call's)."""
    found: dict[str, list[tuple[int, int]]] = {}
    elsewhere: set[str] = set()
    bindings = compiled.plan.bindings
    for symbol in compiled.artifact.manifest.symbols:
        for src in symbol.sources:
            kind, target = bindings[src.input_index]
            place: tuple[int, int] | None = None
            if kind == "leaf" and src.dim is not None:
                place = (target, src.dim)
            elif kind == "size":
                place = (target[0], target[1])
            elif kind == "cache":
                if src.dim == 0 and target[2] in kv_cache_kind(leaves[target[0]]).rows:
                    place = (target[0], 0)
                else:
                    elsewhere.add(symbol.name)
            if place is not None and place not in found.setdefault(symbol.name, []):
                found[symbol.name].append(place)
    return found, elsewhere


def _held_to_ranges(
    compiled: CompiledModel, call: ExampleCall, ranges: Mapping[tuple[int, int], SizeRange]
) -> tuple[Any, dict[str, list[tuple[int, int]]], dict[str, SizeRange]]:
    """A trace's artifact guarded to the declared ranges (refused where its trace serves
    only part of one), with its symbols' places and their declared ranges."""
    places, _ = _symbol_places(compiled, call.leaves)
    declared = _symbol_ranges(places, ranges)
    _refuse_narrowed_ranges(compiled.artifact, declared, places, call)
    return _within_ranges(compiled.artifact, declared), places, declared


def _symbol_ranges(
    places: Mapping[str, list[tuple[int, int]]], ranges: Mapping[tuple[int, int], SizeRange]
) -> dict[str, SizeRange]:
    """Per symbol, the declared range of the dims it is read at (of dims Dynamo found
    equal, the sizes all their ranges hold)."""
    found: dict[str, SizeRange] = {}
    for name, at in places.items():
        for place in at:
            if place in ranges:
                found[name] = found.get(name, SizeRange()).intersect(ranges[place])
    return found


def _refuse_narrowed_ranges(
    artifact: Any,
    declared: Mapping[str, SizeRange],
    places: Mapping[str, list[tuple[int, int]]],
    call: ExampleCall,
) -> None:
    """A declared range the trace serves only part of is refused at compile time, as
    ``torch.export`` refuses a constraint its trace violates: the model's code guarded
    the dim (``if x.shape[1] > 10``, a position table of 32 rows), so calls inside the
    range would be refused. Its least (at least 2, the trace's own bound) and its most
    are each asked of every variant, the other dims at that variant's point."""
    dispatcher = Dispatcher(artifact.manifest)
    names = [symbol.name for symbol in artifact.manifest.symbols]
    traced_most = {symbol.name: symbol.max for symbol in artifact.manifest.symbols}
    for name, size_range in sorted(declared.items()):
        leaf, dim = places[name][0]
        said = f"{call.argument_name(leaf)} dim {dim} was declared to take sizes {size_range}"
        ends = [max(size_range.least, 2)]
        if size_range.most is not None:
            ends.append(size_range.most)
        elif traced_most.get(name) is not None:  # no bound declared, but the trace has one
            raise UnsupportedGraphError(
                f"{said}, but the model's trace serves it up to {traced_most[name]} only "
                f"({name} is that dim); declare ({size_range.least}, {traced_most[name]}) "
                "or less"
            )
        for end in ends:
            points = [[end if n == name else v.point[n] for n in names]
                      for v in artifact.manifest.variants]  # fmt: skip
            if any(dispatcher.admits(v.index, point) for v, point in
                   zip(artifact.manifest.variants, points, strict=True)):  # fmt: skip
                continue
            failed = sorted({g for c in dispatcher.explain(points[0]).candidates
                             for g in c.failed_guards})  # fmt: skip
            raise UnsupportedGraphError(
                f"{said}, but the model's trace does not serve {end}: it holds only where "
                f"{'; '.join(failed) or 'its guards say'} ({name} is that dim); declare a "
                "range the trace serves"
            )


def _within_ranges(artifact: Any, declared: Mapping[str, SizeRange]) -> Any:
    """``artifact`` guarded to the declared ranges of its symbols."""
    for name, size_range in sorted(declared.items()):
        for guard in size_range.guards(name):
            artifact = artifact.excluding(guard)
    return artifact


def _batch_of_one(kv_cache: Any) -> Any:
    """A copy of a KV cache holding its first row, its tensors marked static as the
    example's are: the KV cache a trace at batch 1 takes (the example's own is never
    written)."""
    from ._torch_adapter import with_static_mark

    return kv_cache_kind(kv_cache).batch_of_one(kv_cache, with_static_mark)


def _at_least_two(sizes: Sizes) -> Sizes:
    """The exact sizes the graph traced at 2 or more can serve: below 2, a trace of its
    own serves (see ``_trace_with_pieces``)."""
    if sizes is None:
        return None

    def values(size: Any) -> list[Any]:
        if isinstance(size, Mapping):
            return list(size.values())
        return list(size) if isinstance(size, (list, tuple)) else [size]

    return [s for s in sizes if all(not isinstance(v, int) or v >= 2 for v in values(s))]


def _hints_besides(hints: Hints, call: ExampleCall, at_one: set[tuple[int, int]]) -> Hints:
    """Per-dim hints less those of dims a piece fixes at 1 (and symbol names, which
    name the first trace's symbols)."""
    if not isinstance(hints, Mapping):
        return hints
    fixed = {(call.paths[leaf], dim) for leaf, dim in at_one}
    return {key: value for key, value in hints.items()
            if isinstance(key, tuple) and tuple(key) not in fixed}  # fmt: skip


def _where(call: ExampleCall, places: list[tuple[int, int]]) -> str:
    """The argument dims a length is read from, as a caller names them."""
    return "/".join(f"{call.argument_name(leaf)} dim {dim}" for leaf, dim in places)


def _check_dynamic(
    plan: ModelPlan,
    manifest: Any,
    dims: Mapping[int, set[int]],
    call: ExampleCall,
) -> None:
    """Every dim asked to be dynamic is a symbol in the graph (where the graph reads that
    argument); Dynamo specializes a dim the model's code fixes, and the variants would
    then serve one size only."""
    paths = call.paths
    bound: dict[tuple[int, int], Any] = {}
    for index, (kind, target) in enumerate(plan.bindings):
        spec = manifest.inputs[index]
        if kind == "leaf":
            for dim, size in enumerate(getattr(spec, "shape", ())):
                bound[(target, dim)] = size
        elif kind == "cache" and target[2] in kv_cache_kind(call.leaves[target[0]]).rows:
            bound.setdefault((target[0], 0), getattr(spec, "shape", (None,))[0])
    for leaf, wanted in dims.items():
        for dim in sorted(wanted):
            size = bound.get((leaf, dim))
            if isinstance(size, int):
                raise UnsupportedGraphError(
                    f"dynamic dim {dim} of argument {paths[leaf]!r} was "
                    f"specialized to {size} by the trace (the model's code fixes it); the "
                    "compiled model could serve that size only",
                    specialized=(argument_name(paths[leaf]), dim),
                )


def _graph_dims(
    value: Mapping[Any, Any], example_inputs: list[Any], call: ExampleCall
) -> dict[Any, Any]:
    """Per-dim ``hints``/``sizes`` keyed by ``(argument, dim)`` (positional index or
    keyword name, as ``dynamic=`` names them) re-keyed by the graph input that argument
    became; symbol names pass through."""
    by_id = {id(value): index for index, value in enumerate(example_inputs)}
    found: dict[Any, Any] = {}
    for key, item in value.items():
        if not isinstance(key, tuple):
            found[key] = item
            continue
        argument, dim = key if len(key) == 2 else (None, None)
        matches = [
            by_id[id(leaf)]
            for leaf, path in zip(call.leaves, call.paths, strict=True)
            if path == argument and isinstance(leaf, torch.Tensor) and id(leaf) in by_id
        ]
        if not matches or not isinstance(dim, int):
            raise InvalidOptionError(
                f"hints/sizes name {key!r}: (argument, dim) where argument is a positional "
                "index or keyword name of a tensor the graph takes"
            )
        found[(matches[0], dim)] = item
    return found


def load_model(
    model: torch.nn.Module,
    path: str | os.PathLike[str] | None = None,
    **options: Any,
) -> CompiledModel:
    """A saved compiled model (``CompiledModel.save``) bound to ``model``; no tracing."""
    return CompiledModel.load(model, path, **options)
