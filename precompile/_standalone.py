"""``precompile.standalone_compile``: upstream's API, compiled into checked variants."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from precompile.cache import ArtifactCache, CacheOption, get_or_build, resolve_cache, sha256_hex
from precompile.runtime import (
    CompiledArtifact,
    IncompatibleArtifactError,
    InvalidOptionError,
    LeanCall,
    Manifest,
    PrecompileError,
    Symbol,
    SymbolSource,
    UnsupportedGraphError,
    UntrustedArtifactError,
    Variant,
)
from precompile.runtime.compiler_interface import (
    ABOUT_BLOCKS,
    ABOUT_GRAPH,
    CudaGraphsOption,
    InputSpec,
    IntInput,
    MemoryPayloads,
    ProcessGroupSpec,
    TensorInput,
    code_digest,
    cudagraph_options,
    current_environment,
    dtype_name,
    file_digest,
    move_refusal,
    store_artifact,
)
from precompile.runtime.compiler_interface import describe_process_groups as describe_groups
from precompile.runtime.compiler_interface import load_cached_artifact as load_cached

from . import _gpu_lean as gpu_lean
from . import _repeated_blocks as repeated_blocks
from . import _torch_adapter as adapter
from . import _variant_compile as variant_compile
from ._cache_key import cache_factors, cache_key, one_device_index
from ._collectives import LocalCollectives, graph_collectives
from ._compiled_payload import InputUse, variant_code_digest
from ._graph import GraphDescription
from ._graph_description import DYNAMIC_SHAPES, describe_graph
from ._graph_name import graph_name
from ._lean_plan import LeanPlan, lean_plan
from ._offline import is_offline, refuse
from ._operator_kernels import operator_kernel_code
from ._precision_policy import check_switch as check_casts_switch
from ._random_policy import graph_draws_random, inductors_random_numbers
from ._variant_plan import DEFAULT_MAX_VARIANTS, Hints, Sizes, VariantRequest, plan_variants
from ._variant_workers import variant_workers

log = logging.getLogger("precompile.compile")


def _symbols(graph: GraphDescription) -> tuple[Symbol, ...]:
    found: dict[sympy.Symbol, list[SymbolSource]] = {s: [] for s in graph.symbols}
    for index, item in enumerate(graph.inputs):
        if item.kind == "int" and item.value in found:
            found[item.value].append(SymbolSource(index, None))
        for dim, size in enumerate(item.shape):
            if size in found:
                found[size].append(SymbolSource(index, dim))
    symbols = []
    for symbol, sources in found.items():
        if not sources:
            raise UnsupportedGraphError(
                f"symbol {symbol} never appears alone as an input size or int input, so its "
                "value cannot be read from a call's inputs"
            )
        low, high = graph.ranges[symbol]
        symbols.append(Symbol(str(symbol), tuple(sources), low, high))
    return tuple(symbols)


def _size_text(expr: sympy.Expr) -> int | str:
    return int(expr) if expr.is_Integer else adapter.print_expr(expr)


def _input_specs(
    graph: GraphDescription, uses: Sequence[InputUse], grad_proven_unused: bool
) -> tuple[InputSpec, ...]:
    """The manifest's inputs. ``grad_proven_unused``: the variants were compiled with grad
    enabled and without a backward graph, so no input that required grad then reaches an
    output (AOTAutograd would have compiled one otherwise)."""
    known = set(graph.symbols)
    specs: list[InputSpec] = []
    for index, (item, use) in enumerate(zip(graph.inputs, uses, strict=True)):
        if item.kind == "int":
            specs.append(IntInput(_size_text(item.value), name=item.name))
            continue
        assert item.dtype is not None and item.device is not None
        for stride in item.stride:
            if not stride.free_symbols <= known:
                raise UnsupportedGraphError(
                    f"input {index}'s stride {stride} uses symbols that are no input's size, "
                    "so a call's strides could not be checked"
                )
        offset = item.storage_offset
        specs.append(
            TensorInput(
                dtype=dtype_name(item.dtype),
                device=str(item.device),
                shape=tuple(_size_text(s) for s in item.shape),
                stride=tuple(_size_text(s) for s in item.stride),
                storage_offset=int(offset) if offset.is_Integer else None,
                requires_grad=item.requires_grad,
                mutation=use.mutation,  # type: ignore[arg-type]
                aliased=use.aliased,
                value=item.scalar,
                static_address=item.static_address,
                grad_unused=grad_proven_unused and item.requires_grad,
                index_rows=item.index_rows,
                name=item.name,
            )
        )
    return tuple(specs)


def _output_shapes(graph: GraphDescription) -> tuple[tuple[int | str, ...] | None, ...] | None:
    """Output shapes over the graph's symbols (a shape using any other symbol: None)."""
    if graph.output_shapes is None:
        return None
    known = set(graph.symbols)
    return tuple(
        None
        if shape is None or any(not s.free_symbols <= known for s in shape)
        else tuple(_size_text(s) for s in shape)
        for shape in graph.output_shapes
    )


def _holds(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> bool:
    """Whether ``expr`` holds with each symbol at its value."""
    return bool(sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values.items()}))


def pinning_guards(guards: Sequence[sympy.Expr]) -> list[sympy.Expr]:
    """The guards that hold a dynamic dim to one value (``Eq(s, 12)``): a hint variant with
    one serves that size alone. A variant hinted at 0 or 1 specializes there by design
    (a decode step's code for one row), so ``Eq(s, 1)`` is not one of them."""
    return [
        g
        for g in guards
        if isinstance(g, sympy.Eq)
        and any(isinstance(a, sympy.Symbol) for a in g.args)
        and any(a.is_Integer and int(a) > 1 for a in g.args)
    ]


def _warn_if_pinned(number: int, guards: Sequence[sympy.Expr], *, training: bool) -> None:
    pinned = pinning_guards(guards)
    if pinned:
        log.warning(
            "hint variant %d is guarded to one size (%s): it serves that size alone, other "
            "sizes find no variant%s",
            number,
            ", ".join(dict.fromkeys(adapter.print_expr(g) for g in pinned)),
            "; it was compiled with grad enabled (it has a backward graph), which pins "
            "masked attention this way: compile under torch.no_grad() to serve"
            if training
            else "; give exact sizes for the sizes you serve",
        )


def _common_guards(
    graph: GraphDescription,
    requests: Sequence[VariantRequest],
    guards: Sequence[tuple[sympy.Expr, ...]],
) -> list[sympy.Expr]:
    """Guards every variant needs: common to all hint variants, true at every exact size.

    Such a guard excludes only sizes no variant could serve, so the caller's ShapeEnv may
    have it (Dynamo then recompiles there instead of calling code outside its
    assumptions). Hint-specific guards stay with their variants.
    """
    hint_guards = [set(g) for r, g in zip(requests, guards, strict=True) if r.kind == "hint"]
    if not hint_guards:
        return []
    statics = [
        dict(zip(graph.symbols, r.point, strict=True)) for r in requests if r.kind == "static"
    ]
    common = sorted(set.intersection(*hint_guards), key=str)
    return [g for g in common if all(_holds(g, point) for point in statics)]


def _propagate_common_guards(graph: GraphDescription, common: Sequence[sympy.Expr]) -> None:
    """Add the common guards that hold at the caller's own hints to its ShapeEnv, and pin
    the floats every variant was specialized to."""
    for item in graph.inputs:
        if item.scalar_symbol is not None:
            adapter.specialize_caller_float(item.scalar_symbol)
    env = graph.caller_shape_env
    if env is None:
        return
    caller_point = dict(graph.hints)
    for expr in common:
        if expr.free_symbols <= set(caller_point) and _holds(expr, caller_point):
            adapter.add_caller_guard(env, expr)


def _outside_the_graph(graph: GraphDescription, point: Sequence[int]) -> str | None:
    """Why the traced graph does not hold at ``point`` (a size outside a symbol's range,
    or a guard of the caller's trace it breaks), or None where it does."""
    values = dict(zip(graph.symbols, point, strict=True))
    for symbol, value in values.items():
        low, high = graph.ranges[symbol]
        if value < low or (high is not None and value > high):
            return f"{symbol}={value} is outside the traced range [{low}, {high or 'inf'}]"
    for guard in graph.caller_guards:
        if not _holds(guard, values):
            return f"the caller's trace holds only where {adapter.print_expr(guard)}"
    return None


def _within_the_graph(
    graph: GraphDescription, requests: Sequence[VariantRequest]
) -> list[VariantRequest]:
    """The requested variants whose point the traced graph holds at; the others are left
    out with a warning (compiled, they could never be called)."""
    kept = []
    for request in requests:
        reason = _outside_the_graph(graph, request.point)
        if reason is None:
            kept.append(request)
            continue
        where = ", ".join(f"{s}={v}" for s, v in zip(graph.symbols, request.point, strict=True))
        log.warning("%s variant at %s is not compiled: %s", request.kind, where, reason)
    if (
        requests
        and not any(r.kind == "hint" for r in kept)
        and any(r.kind == "hint" for r in requests)
    ):
        # every hint broke a guard of the trace: its own sizes still need a variant, or
        # the caller (Dynamo) would find none at the very size it traced
        point = tuple(graph.hints[s] for s in graph.symbols)
        log.warning("compiling a hint variant at the traced sizes %s instead", point)
        kept.insert(0, VariantRequest("hint", point))
    if not kept:
        raise UnsupportedGraphError(
            "no requested variant lies where the traced graph holds: "
            + "; ".join(map(adapter.print_expr, graph.caller_guards))
        )
    return kept


def _reachable(graph: GraphDescription, requests: Sequence[VariantRequest]) -> list[VariantRequest]:
    """The requested variants a call can reach. Inside a torch.compile backend, Dynamo
    traced this graph for sizes of at least its symbols' lower bounds (2, where it traces
    0 and 1 apart) and guards them: a variant at a point below one (a hint of 1 meant for
    the decode steps, which Dynamo's trace at 1 serves) could never be called, so it is
    not compiled. Where that leaves none, the traced sizes get a variant."""
    env = graph.caller_shape_env
    lows: dict[sympy.Symbol, int] = {}
    for symbol in graph.symbols:
        low = adapter.symbol_range(env, symbol)[0] if env is not None else None
        if low is not None:
            lows[symbol] = low
    kept = []
    for request in requests:
        below = [f"{s}={v}" for s, v in zip(graph.symbols, request.point, strict=True)
                 if s in lows and v < lows[s]]  # fmt: skip
        if below:
            log.info(
                "%s variant at %s is not compiled: the traced graph serves %s and up (the "
                "trace at smaller sizes is another graph)", request.kind, ", ".join(below),
                ", ".join(f"{s} = {low}" for s, low in lows.items()),
            )  # fmt: skip
            continue
        kept.append(request)
    if not kept and requests:
        kept.append(VariantRequest("hint", tuple(graph.hints[s] for s in graph.symbols)))
    return kept


def _size_one_requests(
    graph: GraphDescription,
    requests: Sequence[VariantRequest],
    guards: Sequence[tuple[sympy.Expr, ...]],
) -> list[VariantRequest]:
    """Variants at 1 for the dims no compiled variant serves at 1 but whose range holds it.

    Tracing at a hint of 2 or more can leave guards such as ``Ne(s, 1)`` (torch's stride
    rules for a view, say), so a range meant to start at 1 (vLLM's ``[1, max tokens]``,
    a batch of one) would be refused at 1. Such a dim gets a variant specialized at 1,
    the others at their hints: one compile per such dim, found after the requested ones.
    """
    added = []
    for index, symbol in enumerate(graph.symbols):
        point = tuple(1 if n == index else graph.hints[s] for n, s in enumerate(graph.symbols))
        if _outside_the_graph(graph, point) is not None:
            continue
        values = dict(zip(graph.symbols, point, strict=True))
        if any(all(_holds(g, values) for g in gs) for gs in guards):
            continue
        request = VariantRequest("hint", point)
        if request in requests or request in added:
            continue
        log.info(
            "no variant serves %s=1, which its range holds (their guards exclude it): "
            "compiling one more, specialized at 1",
            symbol,
        )
        added.append(request)
    return added


def _compile_here(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    point: Mapping[sympy.Symbol, int],
    request: VariantRequest,
    options: Mapping[str, Any],
    number: int,
    outlined: repeated_blocks.Outlined,
) -> tuple[variant_compile.CompiledVariant, repeated_blocks.Outlined]:
    """One variant compiled in this process; where its repeated blocks outlined fail,
    the graph as traced (and so every later variant: the returned ``outlined``)."""
    try:
        compiled = variant_compile.compile_under_policy(
            gm, graph, point, request, options, number, outlined.gm
        )
        return compiled, outlined
    except PrecompileError:
        raise
    except Exception as exc:
        if outlined.gm is gm:
            raise
        log.info(
            "variant %d: compiling with repeated blocks outlined failed (%s: %s); "
            "compiling the graph as traced", number, type(exc).__name__,
            variant_compile.first_line(exc, 200),
        )  # fmt: skip
        compiled = variant_compile.compile_under_policy(
            gm, graph, point, request, options, number, gm
        )
        return compiled, repeated_blocks.Outlined(gm, ())


def _compile_all(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    symbols: tuple[Symbol, ...],
    requests: Sequence[VariantRequest],
    options: Mapping[str, Any],
    groups: tuple[ProcessGroupSpec, ...] = (),
    called_at_one: bool = True,
) -> tuple[CompiledArtifact, list[sympy.Expr]]:
    """Every variant of ``gm``, inside one inductor cache scope (the caller enters
    ``variant_compile.compiling_in_build_dir``: what one variant compiled, the next finds
    in memory)."""
    names = [s.name for s in symbols]
    payloads: dict[str, bytes] = {}
    by_code: dict[str, str] = {}
    leans: dict[str, LeanCall | None] = {}
    pending: dict[str, LeanPlan] = {}
    variants: list[Variant] = []
    all_guards: list[tuple[sympy.Expr, ...]] = []
    uses: tuple[InputUse, ...] | None = None
    training = False
    grad_enabled = torch.is_grad_enabled()
    queue = _within_the_graph(graph, requests)  # then any variant a dim's 1 needs
    outlined = repeated_blocks.outline(gm)
    # A graph running collectives compiles here: a worker process has no process group.
    spread = () if groups else queue
    with variant_workers(gm, outlined.gm, graph, options, spread) as workers:
        number = -1
        while number + 1 < len(queue):
            number += 1
            request = queue[number]
            point = dict(zip(graph.symbols, request.point, strict=True))
            started = time.perf_counter()
            try:
                compiled = workers.take(request, number) if workers is not None else None
                if compiled is None:
                    compiled, outlined = _compile_here(
                        gm, graph, point, request, options, number, outlined
                    )
            except PrecompileError:
                raise
            except Exception as exc:  # inductor's own failure, whatever its type
                where = ", ".join(f"{n}={v}" for n, v in zip(names, request.point, strict=True))
                reason = variant_compile.first_line(exc, 500)
                if min(request.point, default=2) < 2 and len(queue) > 1:
                    # Below the range the graph was traced for (a slice of s // 2 is empty
                    # at 1): such a point was asked for by default or added here; leave it
                    # out and serve the rest.
                    log.warning(
                        "%s variant at %s is not compiled (inductor: %s: %s); calls there "
                        "find no variant",
                        request.kind,
                        where,
                        type(exc).__name__,
                        reason[:200],
                    )
                    queue.pop(number)
                    number -= 1
                    continue
                raise UnsupportedGraphError(
                    f"inductor could not compile variant {number} ({request.kind}"
                    f"{' ' + where if where else ''}): {type(exc).__name__}: {reason}"
                ) from exc
            if uses is None:
                uses, training = compiled.uses, compiled.training
            elif (uses, training) != (compiled.uses, compiled.training):
                raise UnsupportedGraphError(
                    "variants of this graph disagree on which inputs it writes or aliases, or on "
                    "having a backward graph; precompile cannot give them one input contract"
                )
            guards = (*compiled.guards, *graph.caller_guards)
            if request.kind == "static":
                guards = (*(sympy.Eq(s, v) for s, v in point.items()), *guards)
            else:
                _warn_if_pinned(number, guards, training=compiled.training)
            all_guards.append(guards)
            code = variant_code_digest(compiled.payload)
            shared = code in by_code
            if not shared:
                by_code[code] = sha256_hex(compiled.payload)
                payloads[by_code[code]] = compiled.payload
                plan = lean_plan(compiled.payload, lambda text: sha256_hex(text.encode()))
                leans[code] = plan.lean
                if plan.lean is not None and plan.triton_kernels:
                    leans[code] = None  # until its launches are recorded (_complete_gpu_leans)
                    pending[code] = plan
                elif plan.lean is not None:
                    payloads[plan.lean.source] = plan.source.encode()
                else:
                    log.info(
                        "variant %d loads through upstream's deserializer (not the lean path): %s",
                        number,
                        "; ".join(plan.reasons),
                    )
            texts = tuple(dict.fromkeys(adapter.print_expr(g) for g in guards))
            point_by_name = dict(zip(names, request.point, strict=True))
            for kernel, binary in compiled.kernels:
                payloads[kernel.binary] = binary
            kernels = tuple(kernel for kernel, _ in compiled.kernels)
            variants.append(
                Variant(
                    number,
                    request.kind,
                    point_by_name,
                    texts,
                    by_code[code],
                    code,
                    kernels,
                    leans[code],
                )
            )
            log.info(
                "compiled variant %d/%d (%s %s) in %.1f s; %d guards%s",
                number + 1,
                len(queue),
                request.kind,
                ", ".join(f"{n}={v}" for n, v in point_by_name.items()) or "-",
                time.perf_counter() - started,
                len(texts),
                "; same code as an earlier variant" if shared else "",
            )
            if number + 1 == len(queue) and called_at_one:
                queue += _size_one_requests(graph, queue, all_guards)
    assert uses is not None
    manifest = Manifest(
        environment=current_environment(variant_compile.graph_device(graph)),
        symbols=symbols,
        inputs=_input_specs(graph, uses, grad_enabled and not training),
        variants=tuple(variants),
        training=training,
        output=graph.output_spec,
        output_shapes=_output_shapes(graph),
        process_groups=groups,
        draws_random=graph_draws_random(gm),
    )
    if pending:
        started = time.perf_counter()
        manifest = _complete_gpu_leans(manifest, payloads, pending)
        log.info(
            "recorded the Triton launches of %d variant(s) in %.1f s",
            len(pending), time.perf_counter() - started,
        )  # fmt: skip
    artifact = CompiledArtifact(manifest, MemoryPayloads(payloads))
    return artifact, _common_guards(graph, queue, all_guards)


def _complete_gpu_leans(
    manifest: Manifest, payloads: dict[str, bytes], pending: Mapping[str, LeanPlan]
) -> Manifest:
    """Each GPU variant's lean call completed with its recorded Triton launches (see
    ``_gpu_lean``); a variant whose launches cannot be recorded, or whose lean run differs
    from inductor's, stays on upstream's path (logged)."""
    completed: dict[str, LeanCall] = {}
    for code, plan in pending.items():
        assert plan.lean is not None
        variant = next(v for v in manifest.variants if v.code == code)
        try:
            # A graph's collectives run here as local copies: this rank runs the variant
            # alone (a real all-reduce waited for a rank that was waiting on this compile's
            # lock), and both runs compared get the same stand-ins.
            with LocalCollectives() if manifest.process_groups else contextlib.nullcontext():
                result = gpu_lean.complete(
                    manifest, variant, plan.lean, plan.source, plan.triton_kernels
                )
        except Exception as exc:  # inductor's or the driver's own failure, whatever its type
            result = f"running it at build time failed ({type(exc).__name__}: {str(exc)[:200]})"
        if isinstance(result, str):
            log.info(
                "variant %d loads through upstream's deserializer (not the lean path): %s",
                variant.index,
                result,
            )
            continue
        payloads[plan.lean.source] = plan.source.encode()
        payloads.update(result.binaries)
        completed[code] = result.lean
    variants = tuple(
        dataclasses.replace(v, lean=completed[v.code]) if v.code in completed else v
        for v in manifest.variants
    )
    return dataclasses.replace(manifest, variants=variants)


CalibrateOption = Sequence[Any] | Mapping[str, Any] | None
_CALIBRATE_KEYS = {"sizes", "device", "warmup", "reps", "rounds", "min_gain", "timer"}


def _calibrate_arguments(calibrate: CalibrateOption) -> dict[str, Any] | None:
    """``calibrate=`` as keyword arguments of ``CompiledArtifact.calibrate``."""
    if calibrate is None:
        return None
    if isinstance(calibrate, Mapping):
        unknown = set(calibrate) - _CALIBRATE_KEYS
        if "sizes" not in calibrate or unknown:
            raise InvalidOptionError(
                f"calibrate as a dict needs 'sizes' and takes {sorted(_CALIBRATE_KEYS)}, "
                f"got keys {sorted(calibrate)}"
            )
        return dict(calibrate)
    if isinstance(calibrate, (str, bytes)) or not isinstance(calibrate, Sequence):
        raise InvalidOptionError(
            f"calibrate must be a list of sample sizes or a dict, got {calibrate!r}"
        )
    return {"sizes": list(calibrate)}


# The default of an upstream argument not every supported torch has: passing it at all,
# where the installed torch lacks it, is the TypeError upstream would raise.
_ABSENT: Any = object()


def _check_upstream_arguments(arguments: Mapping[str, Any]) -> None:
    """``aot`` (torch 2.10+) always exists; ``donate_graph_module`` and ``fake_mode`` (2.13)
    only where the installed torch's ``standalone_compile`` takes them."""
    known = adapter.upstream_standalone_parameters()
    for name, value in arguments.items():
        if value is not _ABSENT and name not in known:
            raise TypeError(
                f"standalone_compile() got an unexpected keyword argument {name!r} "
                f"(torch {torch.__version__}'s standalone_compile does not take it)"
            )


def check_policy_switches(options: Mapping[str, Any] | None) -> None:
    """What is checked of ``options`` before anything else, cache hit or not: that it is
    a dict, and the policies' switches in its ``config_patches`` (``fallback_random``,
    ``emulate_precision_casts``: True or False, which a hit's key holds too)."""
    if options is not None and not isinstance(options, Mapping):
        raise InvalidOptionError(
            "options must be a dict of compile_fx keyword arguments, e.g. "
            f"{{'config_patches': {{...}}}}, got {type(options).__name__}"
        )
    inductors_random_numbers(options)
    check_casts_switch(options)


def _check_options(options: Mapping[str, Any] | None) -> None:
    """compile_fx's keywords and inductor's config entries, checked before any compile
    (inductor would fail on a misspelt one in the middle of the first variant's)."""
    if not options:
        return
    keywords = adapter.compile_fx_keywords()
    unknown = sorted(set(options) - keywords) if keywords is not None else []
    if unknown:
        raise InvalidOptionError(
            f"options has {unknown}, which are no keyword of inductor's compile_fx "
            f"(it takes {sorted(keywords or ())}; inductor's settings go in "
            "options['config_patches'])"
        )
    patches = options.get("config_patches")
    if patches is None:
        return
    if not isinstance(patches, Mapping) or not all(isinstance(k, str) for k in patches):
        raise InvalidOptionError(
            "options['config_patches'] must be a dict of inductor config names to values, "
            f"got {type(patches).__name__}"
        )
    missing = adapter.unknown_inductor_config(patches)
    if missing:
        raise InvalidOptionError(
            f"options['config_patches'] names {missing[:5]}, which are no entries of "
            "torch._inductor.config (nested ones are dotted: 'triton.cudagraphs')"
        )


def _check_fake_mode(fake_mode: Any, dynamic_shapes: str) -> None:
    """Refuse a ``fake_mode`` where upstream refuses it, with upstream's reasons."""
    if fake_mode is None:
        return
    if dynamic_shapes != "from_example_inputs":
        raise InvalidOptionError(
            "standalone_compile only supports passing `fake_mode` when "
            f'`dynamic_shapes="from_example_inputs"`, got dynamic_shapes={dynamic_shapes!r}'
        )
    if not adapter.is_fake_mode(fake_mode):
        raise InvalidOptionError(
            f"fake_mode must be a FakeTensorMode, got {type(fake_mode).__name__}"
        )
    if adapter.mode_shape_env(fake_mode) is None:
        raise InvalidOptionError(
            "standalone_compile requires `fake_mode` to have a ShapeEnv when "
            '`dynamic_shapes="from_example_inputs"`'
        )


# Cache keys whose compile raised UnsupportedGraphError in this process (bounded).
_FAILED: dict[str, UnsupportedGraphError] = {}
_FAILED_LIMIT = 256


def _remembering_failure(
    key: str, build: Callable[[], tuple[CompiledArtifact, list[sympy.Expr]]]
) -> tuple[CompiledArtifact, list[sympy.Expr]]:
    try:
        return build()
    except UnsupportedGraphError as exc:
        if len(_FAILED) >= _FAILED_LIMIT:
            del _FAILED[next(iter(_FAILED))]
        _FAILED[key] = exc
        raise


def standalone_compile(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    dynamic_shapes: str = "from_graph",
    options: Mapping[str, Any] | None = None,
    aot: bool = False,
    donate_graph_module: Any = _ABSENT,
    fake_mode: Any = _ABSENT,
    hints: Hints = None,
    sizes: Sizes = None,
    max_variants: int = DEFAULT_MAX_VARIANTS,
    cache: CacheOption = None,
    calibrate: CalibrateOption = None,
    cudagraphs: CudaGraphsOption = None,
    compile: bool = True,
) -> CompiledArtifact:
    """Compile ``gm`` into one variant per hint point plus one per exact size.

    ``gm``, ``example_inputs``, ``dynamic_shapes`` and ``options`` mean what they mean
    for ``torch._inductor.standalone_compile`` (``options`` are compile_fx keyword
    arguments, e.g. ``{"config_patches": {...}}``). With neither ``hints`` nor ``sizes``
    the result is a single variant, like upstream's, but with its guards checked.
    ``aot``, ``donate_graph_module`` and ``fake_mode`` are accepted where the installed
    torch's ``standalone_compile`` takes them (elsewhere they are a ``TypeError``, as
    there); docs/drop-in.md says what each means here: every artifact is already
    self-contained as upstream's ``aot=True`` ones, the caller's graph is never mutated,
    and ``fake_mode`` is checked as upstream checks it.
    ``cache``: None uses the default cache, False none, a path or ArtifactCache that one.
    ``calibrate``: sample sizes (or a dict of ``CompiledArtifact.calibrate`` arguments) to
    time every variant at on this device after compiling; the table is cached with it.
    ``cudagraphs``: replay CUDA graphs captured per size (``True``, a dict or a
    ``CudaGraphs``), kept as the artifact's default; capture never compiles anything.
    ``compile=False`` (or ``PRECOMPILE_OFFLINE=1``): never compile; a cache miss raises
    ``ArtifactNotFoundError`` naming the key and the nearest entry's differing factors.
    """
    _check_upstream_arguments(
        {"aot": aot, "donate_graph_module": donate_graph_module, "fake_mode": fake_mode}
    )
    offline = is_offline(compile)
    if not isinstance(aot, bool):
        raise InvalidOptionError(f"aot must be True or False, got {aot!r}")
    if donate_graph_module is not _ABSENT and not isinstance(donate_graph_module, bool):
        raise InvalidOptionError(
            f"donate_graph_module must be True or False, got {donate_graph_module!r}"
        )
    if not isinstance(gm, torch.fx.GraphModule):
        raise InvalidOptionError(f"gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    if dynamic_shapes not in DYNAMIC_SHAPES:
        raise InvalidOptionError(
            f"dynamic_shapes must be one of {DYNAMIC_SHAPES}, got {dynamic_shapes!r}"
        )
    check_policy_switches(options)
    _check_fake_mode(None if fake_mode is _ABSENT else fake_mode, dynamic_shapes)
    graph = describe_graph(gm, list(example_inputs), dynamic_shapes)
    symbols = _symbols(graph)
    names = [s.name for s in symbols]
    dims = {
        (src.input_index, src.dim): s.name
        for s in symbols
        for src in s.sources
        if src.dim is not None
    }
    default_point = [graph.hints[s] for s in graph.symbols]
    requests = plan_variants(
        names, dims, default_point, hints=hints, sizes=sizes, max_variants=max_variants
    )
    if dynamic_shapes == "from_tracing_context":
        requests = _reachable(graph, requests)
    if not symbols and (hints or sizes) and dynamic_shapes != "from_tracing_context":
        # (inside a backend, Dynamo's static first trace is routine: the backend says so)
        log.warning(
            "hints/sizes given, but the graph has no dynamic dims (every size is fixed in "
            "it: traced static, or a size was read as an int, int(symint) say, before the "
            "compile): one static variant is compiled"
        )
    graphs = cudagraph_options(cudagraphs)  # validated before any compile
    calibration = _calibrate_arguments(calibrate)
    if calibration is not None and not symbols:
        log.debug("graph has no dynamic dims: calibrate ignored (one variant, nothing to choose)")
        calibration = None
    collectives = graph_collectives(gm)
    groups = describe_groups(collectives.groups, collectives.opaque)
    if groups and calibration is not None:
        raise InvalidOptionError(
            "calibrate: this graph runs collectives, and calibrating would run them on the "
            "compiling rank alone (the others load its result): it would hang"
        )
    store = resolve_cache(cache)

    def build() -> tuple[CompiledArtifact, list[sympy.Expr]]:
        # on a miss only: reading compile_fx and inductor's config imports them, which a
        # cache hit never does
        _check_options(options)
        # Inside a torch.compile backend (from_tracing_context), Dynamo's lower bound of 2
        # keeps calls at 1 away from this graph (it traces 1 apart): no variant at 1 for
        # it. A graph handed over whole (vLLM's range, from_graph) is called at 1.
        called_at_one = dynamic_shapes == "from_graph"
        cpu = variant_compile.graph_device(graph) == "cpu"
        with variant_compile.compiling_in_build_dir(cpu=cpu):
            artifact, common = _compile_all(
                gm, graph, symbols, requests, options or {}, groups, called_at_one
            )
        if calibration is not None:
            templates = [None if adapter.is_fake(v) else v for v in example_inputs]
            artifact.calibrate(**{"inputs": templates, **calibration})
        return artifact, common

    # A graph on one CUDA device: keyed without its index, so that ranks (or processes) on
    # other devices of this GPU model find it and move it there (see _cached_or_built)
    index = one_device_index(gm, graph)
    device = variant_compile.graph_device(graph)
    factors = cache_factors(gm, graph, requests, options or {}, dynamic_shapes, device, index)
    if index is not None:  # named, so that a miss against an indexed entry says so
        factors["device_index"] = "any (moved to the caller's device at load)"
    if groups:
        # The graph names each group only by its name: what the name stood for is part of
        # what was compiled. No rank: a graph that depends on it has it in its code.
        factors["process_groups"] = repr(
            [(g.name, g.size, g.backend, list(g.ranks)) for g in groups]
        )
    kernel_files, kernel_code = operator_kernel_code(gm)
    kernels = sorted(
        [*filter(None, map(file_digest, kernel_files)), *map(code_digest, kernel_code)]
    )
    if kernels:
        # the Python kernels of custom ops traced through (their code is in the graph's,
        # their names alone in its text): by content, never by path
        factors["operator_kernels"] = repr(kernels)
    if graph.caller_guards:
        # the sizes the traced graph holds at, beyond the ranges the inputs already key
        factors["caller_guards"] = repr(sorted(map(adapter.print_expr, graph.caller_guards)))
    if calibration is not None:
        # The timer is code, not data: a custom one does not enter the key.
        factors["calibrate"] = repr(sorted((k, v) for k, v in calibration.items() if k != "timer"))
    key = cache_key(factors)
    failed = _FAILED.get(key)
    if failed is not None:
        # Dynamo retries a failed backend on every call; the compile would fail again.
        raise UnsupportedGraphError(f"{failed} (failed earlier in this process; not retried)")
    about = {ABOUT_GRAPH: graph_name(gm)}

    def described() -> tuple[CompiledArtifact, list[sympy.Expr]]:
        built = build()
        blocks = repeated_blocks.summary_of(gm)
        if blocks:
            about[ABOUT_BLOCKS] = blocks
        return built

    artifact, common = _cached_or_built(store, key, factors, described, offline, about, index)
    if graphs is not None:
        artifact.set_cudagraphs(graphs, save=True)  # the compile's choice is the default
    _propagate_common_guards(graph, common)
    return artifact


def _cached_or_built(
    store: ArtifactCache | None,
    key: str,
    factors: Mapping[str, str],
    build: Callable[[], tuple[CompiledArtifact, list[sympy.Expr]]],
    offline: bool = False,
    about: Mapping[str, str] | None = None,
    index: int | None = None,
) -> tuple[CompiledArtifact, list[sympy.Expr]]:
    """The artifact under ``key`` and its caller guards, through the cache's get-or-build
    protocol (stored with ``about``, what it is for ``cache ls``).

    ``index``: the graph's one CUDA device index, which ``key`` leaves out. What is built
    is stored under ``key`` where it can move to any other index (``to()``), else under
    a key of this index alone; a load looks for this index's own entry first, then moves
    the shared one here. So of processes on several devices tracing the same graph, one
    compiles (the others wait on ``key``'s lock) and all run its artifact."""
    own = factors if index is None else {**factors, "device_index": str(index)}
    own_key = key if index is None else cache_key(own)

    def save(store: ArtifactCache, built: tuple[CompiledArtifact, list[sympy.Expr]]) -> None:
        artifact, common = built
        shared = index is None
        if not shared:
            manifest = artifact.manifest
            why = move_refusal(manifest, artifact.payload_bytes)
            shared = why is None
            if why is not None:
                log.info("graph %s is stored for cuda:%s alone: %s", key[:12], index, why)
        store_artifact(store, key if shared else own_key, artifact, factors if shared else own,
                       {"caller_guards": pickle.dumps(common)}, about)  # fmt: skip

    def load(store: ArtifactCache) -> tuple[CompiledArtifact, list[sympy.Expr]] | None:
        if index is None:
            return _cached(store, key)
        found = _cached(store, own_key) or _cached(store, key)
        if found is None:
            return None
        artifact, common = found
        try:
            return artifact.to(f"cuda:{index}"), common
        except IncompatibleArtifactError as exc:
            log.warning("graph %s cannot move to cuda:%d (%s); compiling", key[:12], index, exc)
            return None

    return get_or_build(
        store, key, factors,
        load=load,
        build=lambda _: _remembering_failure(key, build),
        save=save,
        refuse=(lambda: refuse(store, key, factors)) if offline else None,
        what="graph",
    )  # fmt: skip


def _cached(store: ArtifactCache, key: str) -> tuple[CompiledArtifact, list[sympy.Expr]] | None:
    try:
        found = load_cached(store, key)
    except UntrustedArtifactError as exc:
        log.warning("%s; compiling instead", exc)
        return None
    if found is None:
        return None
    artifact, aux = found
    # Trusted: the blob passed its sha256 and ownership checks, like the payloads beside it.
    common = pickle.loads(aux["caller_guards"]) if "caller_guards" in aux else []
    return artifact, common
