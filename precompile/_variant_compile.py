"""``compile_variant``: one variant compiled with inductor.

A variant is compiled from a fresh ShapeEnv whose symbols mirror the caller's, with
their backed hints set to the variant's point. The caller's ShapeEnv is never handed to
Inductor, so guards that one variant's compile adds stay with that variant.
"""

from __future__ import annotations

import copy
import logging
import pickle
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from precompile.runtime import NativeKernel, PrecompileError, UnsupportedGraphError
from precompile.runtime.compiler_interface import build_dir

from . import _torch_adapter as adapter
from . import _vec_isa_probe as vec_isa_probe
from ._attention_policy import attention_backends, sdpa_backends, sdpa_switches
from ._compiled_payload import InputUse, built_cpp_kernels, input_uses, settle_triton_kernels
from ._compiler_config import inductor_config_changes
from ._gemm_policy import gemm_options
from ._graph import GraphDescription, has_backward
from ._graph_description import symbol_hint
from ._kernel_checks import raise_index_checks
from ._precision_policy import PATCHES as PRECISION_PATCHES
from ._random_policy import PATCHES as RANDOM_PATCHES
from ._variant_plan import VariantRequest

log = logging.getLogger("precompile.compile")


@dataclass(frozen=True)
class CompiledVariant:
    payload: bytes
    guards: tuple[sympy.Expr, ...]  # in the caller's symbols
    kernels: tuple[tuple[NativeKernel, bytes], ...] = ()  # built C++ kernels and their .so
    uses: tuple[InputUse, ...] = ()
    training: bool = False  # a backward graph was compiled


def _fresh_inputs(
    graph: GraphDescription, point: Mapping[sympy.Symbol, int], dynamic: bool
) -> tuple[list[Any], Any, dict[sympy.Symbol, sympy.Symbol]]:
    fake_mode = adapter.new_fake_mode(specialize_zero_one=False, duck_shape=False)
    shape_env = adapter.mode_shape_env(fake_mode)
    mapping: dict[sympy.Symbol, sympy.Expr] = {}
    for symbol in graph.symbols:
        if dynamic:
            mapping[symbol] = adapter.new_size_symbol(
                shape_env, point[symbol], f"precompile_{symbol}"
            )
        else:
            mapping[symbol] = sympy.Integer(point[symbol])

    def concrete(expr: sympy.Expr) -> Any:
        new = sympy.sympify(expr).xreplace(mapping)
        if new.is_Integer:
            return int(new)
        hint = int(sympy.sympify(expr).xreplace({s: point[s] for s in graph.symbols}))
        return adapter.new_symint(shape_env, new, hint)

    values: list[Any] = []
    for item in graph.inputs:
        if item.kind == "int":
            values.append(concrete(item.value))
            continue
        with fake_mode:
            tensor = torch.empty_strided(
                [concrete(s) for s in item.shape],
                [concrete(s) for s in item.stride],
                dtype=item.dtype,
                device=item.device,
                requires_grad=item.requires_grad,
            )
        if item.scalar is not None:
            # item() of this input returns the constant: the variant is specialized to it.
            adapter.set_item_memo(tensor, shape_env, item.scalar)
        values.append(tensor)
    reverse = {new: old for old, new in mapping.items() if isinstance(new, sympy.Symbol)}
    return values, fake_mode, reverse


def _pinned_to_a_size(shape_env: Any, symbols: Mapping[Any, Any]) -> bool:
    """Whether a compile replaced one of the variant's symbols by a constant."""
    return any(
        symbol in symbols and sympy.sympify(value).is_Integer
        for symbol, value in adapter.replacements(shape_env).items()
    )


@contextmanager
def compiling_in_build_dir(*, cpu: bool = False) -> Iterator[None]:
    """Inductor's cache pointed at this process's build dir for the duration. Entering
    it clears inductor's in-memory caches (compiled kernels, autotuning) and so does
    leaving it: around all the variants of one graph, a kernel or GEMM choice one variant
    compiled is found in memory by the next (and by the recording of their launches),
    instead of being loaded again per variant. Nested, it is entered once.

    ``cpu``: C++ kernels will be built. Inductor probes which vector ISA this machine
    builds for by compiling a test program per ISA (about 6 s on 2 cores), keeps the
    answer for the process and the programs in its cache dir. Asked here first, the
    programs land in the user's inductor cache, as a ``torch.compile`` of theirs would
    leave them, and the next process finds them, instead of in a build dir that dies
    with this one (measured: 7.1 s in a process with an empty cache dir, 1.2 s next;
    ``_vec_isa_probe`` now probes the candidates in parallel, from before the trace)."""
    if _in_build_dir.active:
        yield
        return
    if cpu:
        vec_isa_probe.vec_isa()
    else:
        vec_isa_probe.wait()  # a CPU trace's probes, started before it, finish outside
    with adapter.inductor_cache_dir(build_dir()):
        _in_build_dir.active = True
        try:
            yield
        finally:
            _in_build_dir.active = False


class _BuildDirState(threading.local):
    active = False


_in_build_dir = _BuildDirState()


@contextmanager
def _compile_context(fake_mode: Any, size_oblivious: bool) -> Iterator[None]:
    """Inductor's settings for one variant's compile. ``size_oblivious``: answer 0/1
    questions about sizes (is this dim broadcast?) for every size instead of guarding
    them at the hint, so a variant hinted at 8 also serves 1 (vLLM decodes at 1 token
    through the artifact it compiled for a range traced at a larger size)."""
    patches: dict[str, Any] = {"bundled_autograd_cache": True}
    if adapter.functorch_config_has("force_non_lazy_backward_lowering"):
        patches["force_non_lazy_backward_lowering"] = True
    with ExitStack() as stack:
        stack.enter_context(compiling_in_build_dir())
        # Variants of one graph share an AOTAutograd key; drop earlier entries so a later
        # variant is compiled for its own hints instead of reusing an earlier one's code.
        adapter.clear_aot_autograd_cache(build_dir())
        stack.enter_context(adapter.tracing(fake_mode))
        inductor = {"triton.autotune_at_compile_time": True, **RANDOM_PATCHES, **PRECISION_PATCHES}
        stack.enter_context(adapter.patch_inductor_config(inductor))
        stack.enter_context(adapter.patch_functorch_config(patches))
        stack.enter_context(adapter.rewriting_cpp_kernels(_index_checks_raise))
        # Torch 2.11 times a GEMM template choice handed to the compile workers only after
        # compiling it again, one at a time, in this thread: 246 serial compiles (101 s)
        # in one 4-layer Llama build on an H200. Compiled by autotuning's own threads here,
        # the timing finds each choice built (175.6 -> 114.5 s, the same outputs).
        stack.enter_context(adapter.precompiling_templates_in_threads())
        stack.enter_context(adapter.filtered_inductor_log("select_algorithm", _loud_enough))
        if size_oblivious:
            stack.enter_context(adapter.patch_shape_config({"backed_size_oblivious": True}))
        yield


# Inductor's two reports of a GEMM template choice that failed while autotuning.
_DROPPED_CHOICE = frozenset({
    "Exception %s for benchmark choice %s",
    "Runtime error during autotuning: \n%s. \nIgnoring this choice.",
})  # fmt: skip


def _loud_enough(record: logging.LogRecord) -> bool:
    """Whether inductor's autotuning record is emitted as it is. A template choice that
    needs more shared memory than the GPU has ("out of resource") cannot run there, and
    autotuning drops it, as it should; inductor reports each at ERROR, with a traceback,
    so a build that succeeded looked failed (18 reports, 184 lines, in one build of the
    docs' 4-layer Llama on an H200). Those
    go to this library's DEBUG log; every other failure is reported as inductor reports
    it."""
    if record.msg in _DROPPED_CHOICE and "out of resource" in record.getMessage():
        log.debug("autotuning left out a GEMM choice: %s", record.getMessage()[:300])
        return False
    return True


def _index_checks_raise(source: str) -> str:
    """A C++ kernel whose failed index check raises instead of ending the process (see
    ``_kernel_checks``); one whose layout the rewrite does not know is kept, with a
    warning (its failed check still ends the process)."""
    try:
        return raise_index_checks(source)
    except ValueError as exc:
        log.warning("%s; a failed index check of it ends the process", exc)
        return source


def attention_lengths(gm: torch.fx.GraphModule) -> tuple[sympy.Expr, ...] | None:
    """The query and key lengths (dim -2) of every scaled-dot-product-attention call in
    ``gm``, in the trace's symbols; None where one cannot be read."""
    lengths: list[sympy.Expr] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in adapter.SDPA_TARGETS:
            continue
        for index, name in ((0, "query"), (1, "key")):
            arg = node.args[index] if len(node.args) > index else node.kwargs.get(name)
            value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                return None
            size = value.shape[-2]
            symbolic = isinstance(size, torch.SymInt)
            lengths.append(adapter.symint_expr(size) if symbolic else sympy.Integer(size))
    return tuple(lengths)


def graph_on_cuda(graph: GraphDescription) -> bool:
    """Whether a graph takes a CUDA tensor (where the attention backend matters)."""
    return any(item.device is not None and item.device.type == "cuda" for item in graph.inputs)


def _lengths_pinned(
    shape_env: Any, reverse: Mapping[sympy.Symbol, sympy.Symbol], lengths: Sequence[sympy.Expr]
) -> bool:
    """Whether a variant's guards (its ``shape_env``) hold each of ``lengths`` (in the
    trace's symbols; ``reverse`` maps the variant's symbols to those) to one value."""
    forward = {caller: own for own, caller in reverse.items()}
    for length in lengths:
        expr = sympy.sympify(length).xreplace(forward)
        if expr.free_symbols - set(forward.values()):
            return False
        low, high = adapter.value_range(shape_env, adapter.apply_replacements(shape_env, expr))
        if not (low is not None and low == high):
            return False
    return True


# Triton cuts its cache files' names to 150 characters, while inductor looks a kernel's
# cubin up under the kernel's full name: a longer name (inductor names fused kernels after
# every op they fuse) is not statically launchable, and loading it builds Triton's C
# launcher with gcc. Fused names are cut so that every kernel name stays under 150.
FUSED_NAME_LIMIT = 100


@contextmanager
def _short_kernel_names() -> Iterator[None]:
    if adapter.can_rename_fused_kernels():
        with adapter.renaming_fused_kernels(lambda name: name[:FUSED_NAME_LIMIT]):
            yield
    else:  # a torch without the naming hook: plain numbered names
        with adapter.patch_inductor_config({"triton.descriptive_names": False}):
            yield


def _compile_once(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    point: Mapping[sympy.Symbol, int],
    dynamic: bool,
    options: Mapping[str, Any],
    size_oblivious: bool,
    attention: Mapping[str, bool],
) -> tuple[Any, ...]:
    """One compile of a variant from fresh inputs, its attention backends switched as
    ``attention`` says: their fake mode, the map back to the caller's symbols, the
    payload, its built kernels and input uses."""
    inputs, fake_mode, reverse = _fresh_inputs(graph, point, dynamic)
    with (
        _compile_context(fake_mode, size_oblivious),
        attention_backends(attention),
        _short_kernel_names(),
    ):
        to_compile = copy.deepcopy(gm)
        adapter.forget_unbacked_bindings(to_compile)  # they name the trace's ShapeEnv's symbols
        with adapter.autograd_cache_bypasses() as bypasses:
            compiled = adapter.compile_fx(to_compile, inputs, options)
        if not adapter.serializable(compiled):
            raise UnsupportedGraphError(
                "inductor returned a compiled graph that cannot be serialized (for example "
                "a graph with no operations, or options such as freezing that upstream "
                "cannot save)"
            )
        try:
            payload = adapter.serialize_variant(compiled)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise UnsupportedGraphError(_unsaved(exc, bypasses)) from exc
        payload = settle_triton_kernels(payload)
        kernels = built_cpp_kernels(payload)
        uses, training = input_uses(payload, len(inputs))
    return fake_mode, reverse, payload, kernels, uses, training


def _unsaved(exc: BaseException, bypasses: Sequence[str]) -> str:
    """Why a compiled variant could not be serialized, as AOTAutograd's cache said."""
    said = f"inductor compiled the graph but could not serialize it ({type(exc).__name__}: {exc})"
    if not bypasses:
        return (
            f"{said}; graphs from torch.export's module() wrapper are one known case: "
            "capture the graph with Dynamo (a torch.compile backend) instead"
        )
    reason = bypasses[-1]
    hint = ""
    if "custom pass" in reason:
        hint = (
            ": a custom pass in the config must be a torch._inductor.custom_graph_pass."
            "CustomGraphPass whose uuid() names it (a plain function cannot be saved)"
        )
    return f"{said}: AOTAutograd would not cache it ({reason}){hint}"


def _may_fix_lengths(
    graph: GraphDescription,
    point: Mapping[sympy.Symbol, int],
    lengths: Sequence[sympy.Expr] | None,
) -> bool:
    """Whether every attention length can be fixed in the variant at ``point``: each
    symbol in them at 0 or 1 (which a size-oblivious compile never has); the compile's
    guards confirm it (``compile_variant``)."""
    return (
        graph_on_cuda(graph)
        and lengths is not None
        and all(
            int(point.get(symbol, 2)) <= 1 for length in lengths for symbol in length.free_symbols
        )
    )


def decode_attention_on_cudnn(
    gm: torch.fx.GraphModule, graph: GraphDescription, point: Mapping[sympy.Symbol, int]
) -> bool:
    """Whether the hint variant at ``point`` has attention whose lengths can be fixed
    there (a decode step on a static cache) and is compiled with cuDNN attention for it."""
    lengths = attention_lengths(gm)
    if not lengths or not _may_fix_lengths(graph, point, lengths):
        return False
    return sdpa_backends(sdpa_switches(), dynamic=True, lengths_fixed=True).get("cudnn", False)


def compile_variant(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    point: Mapping[sympy.Symbol, int],
    *,
    dynamic: bool,
    options: Mapping[str, Any],
    to_compile: torch.fx.GraphModule | None = None,
) -> CompiledVariant:
    """Compile one variant with inductor from a fresh ShapeEnv whose symbols mirror the
    caller's, hinted at ``point`` (``dynamic=False``: fixed to it), so the guards this
    compile adds are this variant's alone; returns its payload, those guards in the
    caller's symbols, its built C++ kernels and how it uses its inputs. ``to_compile``:
    the graph inductor is given, where it is not ``gm`` itself (``gm`` with its repeated
    blocks outlined: ``_repeated_blocks``); ``gm`` is what is read (its attention)."""
    compiled_gm = gm if to_compile is None else to_compile
    # A point at 0 or 1 is meant to specialize (a decode step's code for one row); any
    # other dynamic point is traced for every size, 0 and 1 included. Size-oblivious
    # tracing is experimental in torch: where it fails (torch 2.11 lowering a KV-cache
    # graph raised KeyError 'unbacked_bindings'), the variant is compiled with 0/1 guards
    # instead, which keep it away from the sizes it was not traced for.
    size_oblivious = (
        dynamic and all(int(v) >= 2 for v in point.values()) and not has_backward(graph)
    )
    switches = sdpa_switches()
    lengths = attention_lengths(gm) if dynamic else ()
    attention = sdpa_backends(
        switches, dynamic=dynamic, lengths_fixed=_may_fix_lengths(graph, point, lengths)
    )
    retry: str | None = None
    try:
        result = _compile_once(
            compiled_gm, graph, point, dynamic, options, size_oblivious, attention
        )
    except UnsupportedGraphError:
        raise
    except Exception as exc:
        if not size_oblivious or not type(exc).__module__.startswith("torch"):
            raise  # only torch's own compile failures are worth a guarded retry
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        retry = f"size-oblivious compile failed ({type(exc).__name__}: {first_line})"
    else:
        if size_oblivious and _pinned_to_a_size(adapter.mode_shape_env(result[0]), result[1]):
            # Seen with a backward graph of masked attention: size-oblivious tracing held
            # the dim to its hint (12 == s); traced with 0/1 guards it serves every size.
            retry = "size-oblivious compile held a dynamic dim to one size"
    if retry is not None:
        log.info("%s; compiling with 0/1 guards", retry)
        result = _compile_once(compiled_gm, graph, point, dynamic, options, False, attention)
    unfixed = sdpa_backends(switches, dynamic=dynamic, lengths_fixed=False)
    if attention != unfixed and not _lengths_pinned(
        adapter.mode_shape_env(result[0]), result[1], lengths or ()
    ):
        log.info("an attention length stays free in this variant; compiling it without cuDNN")
        result = _compile_once(compiled_gm, graph, point, dynamic, options, False, unfixed)
    elif attention != unfixed and lengths:
        log.info("variant at %s: attention lengths fixed, compiled with cuDNN allowed", point)
    fake_mode, reverse, payload, kernels, uses, training = result
    shape_env = adapter.mode_shape_env(fake_mode)
    guards: list[sympy.Expr] = adapter.recorded_guards(shape_env)
    for symbol, replacement in adapter.replacements(shape_env).items():
        if symbol in reverse:
            guards.append(sympy.Eq(symbol, replacement))
    for symbol in reverse:
        low, high = adapter.symbol_range(shape_env, symbol)
        if low is not None and low > 0:
            guards.append(sympy.Ge(symbol, low))
        if high is not None:
            guards.append(sympy.Le(symbol, high))
    translated = []
    for guard in guards:
        expr = sympy.sympify(guard).xreplace(reverse)
        if not dynamic or not graph.symbols:
            # A static variant (or any variant of a graph with no symbol: one compiled
            # from_example_inputs) has every size fixed, yet AOTAutograd still turns int
            # inputs (a SymInt placeholder's value) into fresh symbols; each equals the
            # int it was made from, which the variant's exact-size guards already pin.
            leftover = expr.free_symbols - set(graph.symbols)
            if leftover:
                hints = {s: symbol_hint(shape_env, s) for s in leftover}
                expr = sympy.simplify(expr.xreplace(hints))
        if expr.free_symbols - set(graph.symbols):
            raise UnsupportedGraphError(
                f"variant guard {guard} involves symbols that are not graph inputs"
            )
        if expr is sympy.true:
            continue
        translated.append(expr)
    return CompiledVariant(payload, tuple(dict.fromkeys(translated)), kernels, uses, training)


def graph_device(graph: GraphDescription) -> str:
    """``cuda`` for a graph that takes a CUDA tensor, else ``cpu``."""
    devices = {str(i.device.type) for i in graph.inputs if i.device is not None}
    return "cuda" if "cuda" in devices else "cpu"


def first_line(exc: BaseException, limit: int) -> str:
    """What an inductor failure says, for a log line or an error: its first line."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""


def compile_under_policy(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    point: Mapping[sympy.Symbol, int],
    request: VariantRequest,
    options: Mapping[str, Any],
    number: int,
    to_compile: torch.fx.GraphModule | None = None,
) -> CompiledVariant:
    """One variant, its GEMMs as ``_gemm_policy`` says; where inductor cannot compile
    them so, with the caller's options (an INFO log says why)."""
    dynamic = request.kind == "hint"
    # A point with every symbol at 0 or 1 is specialized by the trace: one size is served.
    serves_many = dynamic and any(int(value) >= 2 for value in point.values())
    device = graph_device(graph)
    chosen = gemm_options(
        options, device=device, dynamic=serves_many, caller_config=inductor_config_changes(),
        cudnn_decode=serves_many and device == "cuda"
        and decode_attention_on_cudnn(gm, graph, point),
    )  # fmt: skip
    if chosen is not None:
        try:
            return compile_variant(
                gm, graph, point, dynamic=dynamic, options=chosen, to_compile=to_compile
            )
        except PrecompileError:
            raise
        except Exception as exc:  # inductor's own failure, whatever its type
            log.info(
                "variant %d: Triton GEMM templates failed (%s: %s); compiling with inductor's "
                "default GEMMs",
                number,
                type(exc).__name__,
                first_line(exc, 200),
            )
    return compile_variant(
        gm, graph, point, dynamic=dynamic, options=options, to_compile=to_compile
    )
