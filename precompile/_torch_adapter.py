"""Every private torch API the compile side touches (Dynamo, Inductor, AOTAutograd,
ShapeEnv, fake tensors, pytree), each behind a small function that decides nothing.

What the compile side does with them lives in modules named for it (``_graph_description``,
``_variant_compile``, ``_compiled_payload``, ``_compiler_config``, ``_collectives``,
``_model_trace``, ``_graph_name``, ``_lean_scan``, ``_lean_plan``): a torch upgrade that
moves one of these APIs changes this file, and the runtime's adapter whose plumbing this
one shares.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import pickle
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from precompile.cache import sha256_hex
from precompile.runtime import _torch_adapter as runtime_adapter
from precompile.runtime.compiler_interface import TritonLaunch

if TYPE_CHECKING:  # sympy is imported where it is used: a warm lookup imports none of it
    import sympy


# -- standalone_compile's signature -------------------------------------------------
@functools.cache
def upstream_standalone_parameters() -> frozenset[str]:
    """The keyword arguments the installed torch's ``standalone_compile`` takes (2.10 and
    2.11 lack ``donate_graph_module`` and ``fake_mode``, 2.13 has both)."""
    from torch._inductor import standalone_compile as upstream

    return frozenset(inspect.signature(upstream).parameters)


# -- Dynamo: marks, the tracing context, guards ----------------------------------------
def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Dynamo's ``mark_dynamic``: trace ``dim`` of ``tensor`` as a symbol."""
    torch._dynamo.mark_dynamic(tensor, dim)


def marked_dynamic_dims(value: Any) -> set[int]:
    """The dims ``torch._dynamo.mark_dynamic`` marked on ``value`` (none for a non-tensor);
    Dynamo keeps them in a private attribute."""
    return set(getattr(value, "_dynamo_dynamic_indices", None) or ())


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask Dynamo to trace ``dim`` of ``tensor`` as a symbol without ``mark_dynamic``'s
    constraints: dims found equal to each other (``input_ids`` and ``position_ids``
    lengths) share one symbol, where torch 2.11 fails the trace; the caller checks
    afterwards that each dim did become a symbol."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _is_dynamo_mark(name: str) -> bool:
    return name.startswith("_dynamo_") or name == "_has_dynamo_dim_marking"


@contextmanager
def marks_put_back(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Dynamo's marks (``mark_dynamic``'s and the others, its ``_dynamo_*`` attributes)
    made on ``tensors`` inside the block are taken off after it, and the ones they had
    put back: a trace's marks stay that trace's."""
    unique = list({id(t): t for t in tensors}.values())
    before = [
        (t, {k: copy.copy(v) for k, v in vars(t).items() if _is_dynamo_mark(k)}) for t in unique
    ]
    try:
        yield
    finally:
        for tensor, marks in before:
            for name in [k for k in vars(tensor) if _is_dynamo_mark(k) and k not in marks]:
                delattr(tensor, name)
            for name, value in marks.items():
                setattr(tensor, name, value)


def with_static_mark(original: torch.Tensor, copied: torch.Tensor) -> torch.Tensor:
    """``copied`` with Dynamo's static-address mark where ``original`` has one
    (transformers marks a StaticCache's tensors: a graph writes them in place, and a
    CUDA graph replays on them only while they keep one address)."""
    mark = getattr(original, "_dynamo_static_input_type", None)
    if mark is not None:
        copied._dynamo_static_input_type = mark  # type: ignore[attr-defined]
    return copied


def with_dynamo_marks(original: torch.Tensor, copied: torch.Tensor) -> torch.Tensor:
    """``copied`` with every mark Dynamo keeps on ``original`` (``mark_dynamic``'s dims
    and ranges, ``mark_static``, the static-address mark: its ``_dynamo_*`` attributes),
    so a copy is traced as the original would be."""
    for name, value in vars(original).items():
        if name.startswith("_dynamo_"):
            setattr(copied, name, copy.copy(value))
    return copied


def has_static_mark(value: Any) -> bool:
    """Whether ``value`` carries Dynamo's static-address mark."""
    return getattr(value, "_dynamo_static_input_type", None) is not None


def placeholder_marked_static(node: torch.fx.Node) -> bool:
    """Whether Dynamo recorded its static-address mark on a placeholder's tensor."""
    return node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") is not None


def placeholder_source_name(node: torch.fx.Node) -> str | None:
    """Dynamo's source of a placeholder (``L['x']``), where it recorded one."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):  # a method in torch 2.11, a property in 2.13
        name = name()
    return name if isinstance(name, str) and name else None


def tracing_fake_mode() -> Any | None:
    """The fake mode of the active tracing context (inside a torch.compile backend)."""
    context = torch._guards.TracingContext.try_get()
    return None if context is None else context.fake_mode


def traced_codes() -> list[Any]:
    """The code objects the active Dynamo trace went through: the frame it compiles
    first, the functions it inlined after (none outside a trace)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return list(getattr(context, "traced_code", None) or [])


def top_frame_wrapper(compiled: Any) -> Any | None:
    """The function Dynamo runs as the top frame of a ``torch.compile``'d module in place
    of its forward, where it wraps one: ``external_utils.wrap_inline``'s ``inner``, whose
    closure holds the module (torch.nn's own modules, whose forward Dynamo traces only
    inlined, and every module under ``config.wrap_top_frame``). None where Dynamo traces
    the module's own frame."""
    from torch._dynamo import external_utils

    wrapper_code = external_utils.wrap_inline(len).__code__
    function = getattr(compiled, "forward", None)
    for _ in range(8):  # the compile context's wrapper, then what it wraps
        if function is None or isinstance(function, torch.nn.Module):
            return None
        if getattr(function, "__code__", None) is wrapper_code:
            return function
        function = getattr(function, "__wrapped__", None)
    return None


def torch_code_dirs() -> tuple[str, str]:
    """The folders of torch's own code and of Dynamo's (each ending in a separator)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    return torch_dir, os.path.join(torch_dir, "_dynamo") + os.sep


def graph_break_error() -> type[Exception]:
    """What a ``fullgraph`` trace raises at a graph break."""
    return torch._dynamo.exc.Unsupported  # type: ignore[no-any-return]


def trace_user_error() -> type[Exception]:
    """What a trace raises where the traced code asks what tracing cannot answer (a guard
    on a data-dependent value, a constraint on a dynamic dim)."""
    return torch._dynamo.exc.UserError  # type: ignore[no-any-return]


def backend_failure(exc: BaseException) -> BaseException | None:
    """What a ``torch.compile`` backend raised, where ``exc`` is Dynamo's wrapper of it."""
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
        return exc.inner_exception  # type: ignore[no-any-return]
    return None


@dataclass(frozen=True)
class GuardEntry:
    """One of Dynamo's guards on a trace: its type (and the types it implies), the
    source it reads (a Python expression over ``L`` and ``G``), the value it read, and
    the guard's own argument where it has one (an attribute name, a dict key, the
    other source of an aliasing guard)."""

    guard_type: str
    derived_types: tuple[str, ...]
    source: str
    has_value: bool
    value: Any
    argument: Any = None


def guard_entry(entry: Any) -> GuardEntry:
    """An entry of ``torch.compile``'s ``guard_filter_fn``, as plain data."""
    guard = entry.orig_guard
    keywords = getattr(guard.create_fn, "keywords", None) or {}
    argument: Any = None
    for name in ("attr", "key"):
        if name in keywords:
            argument = keywords[name]
    other = keywords.get("source_b")
    if other is not None:
        argument = ("source", other.name if isinstance(other.name, str) else other.name())
    source = guard.originating_source
    text = source.name if isinstance(source.name, str) else source.name()
    return GuardEntry(
        str(entry.guard_type),
        tuple(str(t) for t in entry.derived_guard_types),
        str(text),
        bool(entry.has_value),
        entry.value if entry.has_value else None,
        argument,
    )


# -- ShapeEnv and symbolic values ------------------------------------------------------
def shape_env_of(value: Any) -> Any | None:
    """The ShapeEnv a SymInt, or a fake tensor's mode, belongs to."""
    if isinstance(value, torch.SymInt):
        return value.node.shape_env
    fake_mode = getattr(value, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


def mode_shape_env(fake_mode: Any) -> Any | None:
    """The ShapeEnv of a fake mode (None where it has none)."""
    return getattr(fake_mode, "shape_env", None)


def symint_expr(value: torch.SymInt) -> sympy.Expr:
    """The sympy expression a SymInt stands for."""
    return value.node.expr  # type: ignore[no-any-return]


def apply_replacements(shape_env: Any, expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with the replacements ``shape_env`` has recorded (``s1 -> s0``) applied."""
    return shape_env.replace(expr)  # type: ignore[no-any-return]


def size_hint(shape_env: Any, symbol: sympy.Symbol) -> int | None:
    """The value ``shape_env`` traced ``symbol`` at (None: an unbacked symbol)."""
    table = getattr(shape_env, "backed_var_to_val", None)  # torch 2.13
    if table is None:
        table = shape_env.var_to_val
    return int(table[symbol]) if symbol in table else None


def _integers(bounds: Any) -> tuple[int | None, int | None]:
    lower = int(bounds.lower) if bounds.lower.is_Integer else None
    upper = int(bounds.upper) if bounds.upper.is_Integer else None
    return lower, upper


def symbol_range(shape_env: Any, symbol: sympy.Symbol) -> tuple[int | None, int | None]:
    """The range ``shape_env`` holds ``symbol`` to (None for an end that is no integer)."""
    bounds = shape_env.var_to_range.get(symbol)
    return (None, None) if bounds is None else _integers(bounds)


def value_range(shape_env: Any, expr: sympy.Expr) -> tuple[int | None, int | None]:
    """The range ``shape_env``'s symbol ranges give ``expr`` (None for an end that is no
    integer)."""
    return _integers(shape_env.bound_sympy(expr))


def recorded_guards(shape_env: Any) -> list[sympy.Expr]:
    """The guards ``shape_env`` recorded, as sympy expressions."""
    return [guard.expr for guard in getattr(shape_env, "guards", ())]


def replacements(shape_env: Any) -> Mapping[sympy.Symbol, sympy.Expr]:
    """The symbols ``shape_env`` replaced, with what it replaced each by."""
    return shape_env.replacements  # type: ignore[no-any-return]


def add_caller_guard(shape_env: Any, expr: sympy.Expr) -> None:
    """Record ``expr`` (true at the caller's hints) as a guard of the caller's ShapeEnv."""
    shape_env.evaluate_expr(expr)


def specialize_caller_float(symbol: Any) -> None:
    """Pin a caller's SymFloat to its value (Dynamo then guards on it, and recompiles
    for another value instead of calling variants specialized to this one)."""
    float(symbol)


def print_expr(expr: sympy.Expr) -> str:
    """Python syntax for an integer/boolean sympy expression (what artifacts store)."""
    from torch.utils._sympy.printers import PythonPrinter

    return str(PythonPrinter().doprint(expr))


def new_fake_mode(*, specialize_zero_one: bool, duck_shape: bool) -> Any:
    """A fake tensor mode over a fresh ShapeEnv of these settings."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv(specialize_zero_one=specialize_zero_one, duck_shape=duck_shape)
    return FakeTensorMode(shape_env=shape_env)


def forget_unbacked_bindings(gm: torch.fx.GraphModule) -> None:
    """Drop which unbacked symbol (``u0``: a value read from a tensor, ``.item()``) each
    of ``gm``'s nodes bound in the trace's ShapeEnv. AOTAutograd's retrace renames each
    new symbol to its node's old one, which a fresh ShapeEnv does not have (inductor
    failed: "u0 possible memo disaster", or an AttributeError once they were numbered
    apart); without the bindings the new symbols keep their own names."""
    for node in gm.graph.nodes:
        node.meta.pop("unbacked_bindings", None)


def new_size_symbol(shape_env: Any, hint: int, name: str) -> sympy.Expr:
    """A new dynamic size symbol of ``shape_env``, backed at ``hint``."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    return shape_env.create_symbol(  # type: ignore[no-any-return]
        hint, source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC
    )


def new_symint(shape_env: Any, expr: sympy.Expr, hint: int) -> torch.SymInt:
    """A SymInt of ``shape_env`` for ``expr``, hinted at ``hint``."""
    return shape_env.create_symintnode(expr, hint=hint)  # type: ignore[no-any-return]


# -- fake tensors ---------------------------------------------------------------------
def is_fake(value: Any) -> bool:
    """Whether ``value`` is a FakeTensor (shape only, cannot run a kernel)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def is_fake_mode(value: Any) -> bool:
    """Whether ``value`` is a FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return isinstance(value, FakeTensorMode)


def fake_mode_of(value: Any) -> Any:
    """The mode a FakeTensor belongs to."""
    return value.fake_mode


def item_memo(value: Any) -> Any:
    """What ``item()`` of a 0-d FakeTensor returns (None before it was asked)."""
    return value.item_memo


def set_item_memo(tensor: Any, shape_env: Any, value: float) -> None:
    """Make ``item()`` of a 0-d FakeTensor return ``value`` (a SymFloat of ``shape_env``
    hinted at it, which the fake tensor keeps across retraces)."""
    import sympy
    from torch.fx.experimental.sym_node import SymNode

    tensor.item_memo = torch.SymFloat(SymNode(sympy.Float(value), shape_env, float, hint=value))


def symfloat_hint(value: torch.SymFloat) -> Any:
    """The value a SymFloat was traced at (None where it has none)."""
    return value.node.hint


def fake_run(func: Any, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` run on fake tensors (real inputs taken as fakes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return func(*args, **kwargs)


def run_on_example_values(node: torch.fx.Node) -> None:
    """Call a graph node's operator on clones of the values its inputs were traced with
    (``example_value``), in their fake mode: what tracing it ran, run again alone.
    ``LookupError`` where an input has no recorded value."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.node import map_arg
    from torch.utils import _pytree as pytree

    missing: list[str] = []

    def value(arg: torch.fx.Node) -> Any:
        found = example_value(arg)
        if found is None:
            missing.append(arg.name)
        return found

    args, kwargs = map_arg((node.args, node.kwargs), value)
    if missing:
        raise LookupError(f"no traced value for {', '.join(missing)}")
    fakes = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else None
    with mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True):
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, (args, kwargs))
        node.target(*args, **kwargs)  # type: ignore[operator]


def operator_registration_sites(qualified: str) -> set[str]:
    """The files the dispatcher says an operator's schema and kernels were registered
    at (``registered at path:line``: for a ``torch.library.Library``, where it was made)."""
    try:
        dump = torch._C._dispatch_dump(qualified)
    except RuntimeError:  # not a registered operator
        return set()
    return {m.group(1) for m in re.finditer(r"registered at (.+?):\d+", dump)}


# -- operators ------------------------------------------------------------------------
# torch's scaled-dot-product-attention callables as a graph names them
SDPA_TARGETS = (
    torch._C._nn.scaled_dot_product_attention,
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


def _signature(schema: Any) -> tuple[str, tuple[str, ...]]:
    return schema.name, tuple(argument.name for argument in schema.arguments)


def op_signature(target: Any) -> tuple[str, tuple[str, ...]] | None:
    """An operator's qualified name (``ns::op``) and argument names (a packet's: its
    default overload's), or None where ``target`` is no torch operator."""
    if isinstance(target, torch._ops.OpOverload):
        return _signature(target._schema)
    if isinstance(target, torch._ops.OpOverloadPacket):
        overload = getattr(target, "default", None)
        return None if overload is None else _signature(overload._schema)
    return None


def overload_signature(func: Any) -> tuple[str, tuple[str, ...]]:
    """An operator overload's qualified name (``ns::op``) and argument names."""
    return _signature(func._schema)


def op_namespace(func: Any) -> str:
    """The namespace of an operator overload (``aten``)."""
    return func.namespace  # type: ignore[no-any-return]


def op_return_count(func: Any) -> int:
    """How many values an operator overload returns."""
    return len(func._schema.returns)


# The base class of a mode that sees every operator call (``__torch_dispatch__``).
DispatchMode = TorchDispatchMode


# -- pytree and graph outputs ---------------------------------------------------------
def tree_leaves(value: Any) -> list[Any]:
    """The leaves of a pytree, in upstream's order."""
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(value)  # type: ignore[no-any-return]


def treespec_json(value: Any) -> str:
    """Upstream's pytree spec of ``value``, serialized."""
    from torch.utils import _pytree as pytree

    _, spec = pytree.tree_flatten(value)
    return str(pytree.treespec_dumps(spec))


def module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """The modules Dynamo recorded a node as traced inside, outermost first: each one's
    source path (``L['self'].model.layers.0``, or ``...layers[0]`` in older torch) and
    its class's qualified name. Empty for a node Dynamo did not trace."""
    stack = node.meta.get("nn_module_stack") or {}
    found = []
    for entry in stack.values():
        if not isinstance(entry, tuple) or len(entry) != 2:
            continue
        path, kind = entry
        if isinstance(kind, type):
            kind = f"{kind.__module__}.{kind.__qualname__}"
        found.append((str(path), str(kind)))
    return found


def example_value(node: torch.fx.Node) -> Any:
    """The value Dynamo (``example_value``) or a tracer (``val``) recorded for a node."""
    value = node.meta.get("example_value")
    return node.meta.get("val") if value is None else value


def invoke_subgraph_op() -> Any:
    """The higher-order operator that calls one subgraph from many places of a graph,
    which AOTAutograd traces and inductor compiles once per identifier."""
    return torch.ops.higher_order.invoke_subgraph


def storage_of(value: Any) -> Any:
    """A tensor's storage, comparable across views of it (fake tensors too)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(value.untyped_storage())


def graph_returns_tuple(gm: torch.fx.GraphModule) -> bool:
    """Whether inductor's compile_fx takes the graph's output as it is (a flat tuple)."""
    from torch._inductor.compile_fx import graph_returns_tuple as returns_tuple

    return bool(returns_tuple(gm))


# -- inductor's compile ---------------------------------------------------------------
# Compiling points TORCHINDUCTOR_CACHE_DIR at the build dir through the environment
# (compile workers read it there); every such swap happens under this lock so that our
# threads never see another's dir. Loads steer inductor per thread instead (see
# precompile.runtime._torch_adapter.private_inductor_dir); precompile.runtime._build_dir
# owns the directory.
INDUCTOR_LOCK = threading.RLock()


def _after_fork_in_child() -> None:
    global INDUCTOR_LOCK
    INDUCTOR_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def inductor_cache_dir(directory: str) -> Iterator[None]:
    """Point inductor's cache at ``directory`` for the duration (under INDUCTOR_LOCK)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with INDUCTOR_LOCK, temporary_cache_dir(directory):
        yield


def clear_aot_autograd_cache(directory: str) -> None:
    """Remove the AOTAutograd cache entries under inductor's cache ``directory``."""
    shutil.rmtree(os.path.join(directory, "aotautograd"), ignore_errors=True)


def tracing(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """A tracing context over ``fake_mode``, active for the duration."""
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))  # type: ignore[no-any-return]


def patch_inductor_config(changes: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Inductor's config with ``changes``, for the duration."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(dict(changes))  # type: ignore[no-any-return]


def functorch_config_has(name: str) -> bool:
    """Whether this torch's functorch config has the entry ``name``."""
    import torch._functorch.config as functorch_config

    return hasattr(functorch_config, name)


def patch_functorch_config(changes: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """functorch's (AOTAutograd's) config with ``changes``, for the duration."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(dict(changes))  # type: ignore[no-any-return]


def patch_shape_config(changes: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """The symbolic-shapes config with ``changes``, for the duration."""
    import torch.fx.experimental._config as shape_config

    return shape_config.patch(dict(changes))  # type: ignore[no-any-return]


def can_rename_fused_kernels() -> bool:
    """Whether this torch's inductor has the hook that names fused kernels (2.13)."""
    from torch._inductor.choices import InductorChoices

    return hasattr(InductorChoices, "customize_fused_kernel_name")


class _RenamedFusedKernels:
    """The current InductorChoices, with each fused kernel's name passed through
    ``rename``."""

    def __init__(self, inner: Any, rename: Callable[[str], str]) -> None:
        self._inner = inner
        self._rename = rename

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def customize_fused_kernel_name(self, fused_name: str, src_code: str) -> str:
        return self._rename(str(self._inner.customize_fused_kernel_name(fused_name, src_code)))


@contextmanager
def renaming_fused_kernels(rename: Callable[[str], str]) -> Iterator[None]:
    """Inductor names fused kernels ``rename(its own name)`` for the duration (where
    ``can_rename_fused_kernels``)."""
    from torch._inductor.virtualized import V

    with V.set_choices_handler(_RenamedFusedKernels(V.choices, rename)):
        yield


@contextmanager
def rewriting_cpp_kernels(rewrite: Callable[[str], str]) -> Iterator[None]:
    """Each C++ kernel inductor's CPU codegen writes for the duration is ``rewrite(its
    source)`` (before it is built, cached or put into the wrapper)."""
    from torch._inductor.codegen.cpp import KernelGroup

    original = KernelGroup.codegen_group

    def codegen_group(self: Any, name: Any = None) -> str:
        return rewrite(original(self, name))

    KernelGroup.codegen_group = codegen_group  # type: ignore[method-assign]
    try:
        yield
    finally:
        KernelGroup.codegen_group = original  # type: ignore[method-assign]


class _InThreads(threading.local):
    active = False


_templates_in_threads = _InThreads()


@contextmanager
def precompiling_templates_in_threads() -> Iterator[None]:
    """For the duration, GEMM template choices that autotuning is about to time are
    compiled by select_algorithm's own thread pool in this process, never handed to the
    compile-worker processes. Only in this thread: a compile another thread runs meanwhile
    decides as inductor would."""
    from torch._inductor import select_algorithm
    from torch._inductor.async_compile import AsyncCompile

    original_make = getattr(select_algorithm.AlgorithmSelectorCache, "make_precompile_fn", None)
    original_use = AsyncCompile.__dict__.get("use_process_pool")
    if original_make is None or not isinstance(original_use, (classmethod, staticmethod)):
        yield  # a torch laid out otherwise: its autotuning runs as it would
        return
    use_process_pool = original_use.__get__(None, AsyncCompile)

    def make_precompile_fn(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, _templates_in_threads.active = _templates_in_threads.active, True
        try:
            return original_make(self, *args, **kwargs)
        finally:
            _templates_in_threads.active = outer

    def use_process_pool_here(cls: Any) -> bool:
        return False if _templates_in_threads.active else bool(use_process_pool())

    with INDUCTOR_LOCK:
        select_algorithm.AlgorithmSelectorCache.make_precompile_fn = make_precompile_fn  # type: ignore[method-assign]
        AsyncCompile.use_process_pool = classmethod(use_process_pool_here)  # type: ignore[method-assign,assignment,arg-type]
        try:
            yield
        finally:
            select_algorithm.AlgorithmSelectorCache.make_precompile_fn = original_make  # type: ignore[method-assign]
            AsyncCompile.use_process_pool = original_use  # type: ignore[method-assign]


@contextmanager
def filtered_inductor_log(module: str, keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """For the duration, the records of inductor's logger for ``module`` (as
    ``select_algorithm``) are emitted only where ``keep(record)`` says so."""
    logger = logging.getLogger(f"torch._inductor.{module}")

    class _Keep(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return keep(record)

    kept = _Keep()
    logger.addFilter(kept)
    try:
        yield
    finally:
        logger.removeFilter(kept)


_BYPASS = "Bypassing autograd cache due to: %s"


@contextmanager
def autograd_cache_bypasses() -> Iterator[list[str]]:
    """For the duration, the reasons AOTAutograd's cache gives for not caching a graph
    (its INFO records, which torch's own logging leaves unprinted: they still are). A
    graph it does not cache has no serializable compiled function."""
    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    reasons: list[str] = []
    shown = logger.getEffectiveLevel()

    class _Record(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.msg == _BYPASS and record.args:
                reasons.append(
                    str(record.args[0] if isinstance(record.args, tuple) else record.args)
                )
            return record.levelno >= shown

    recorder = _Record()
    level = logger.level
    logger.setLevel(min(shown, logging.INFO))
    logger.addFilter(recorder)
    try:
        yield reasons
    finally:
        logger.removeFilter(recorder)
        logger.setLevel(level)


def compile_fx_keywords() -> frozenset[str] | None:
    """The keyword arguments inductor's compile_fx takes besides the graph and inputs;
    None where it takes any (a wrapper someone put in its place: ``**kwargs``)."""
    import inspect

    from torch._inductor.compile_fx import compile_fx as upstream

    parameters = inspect.signature(upstream).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters) - {"model_", "example_inputs_"}


def unknown_inductor_config(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are no entry of inductor's config (dotted for nested
    ones, ``"triton.cudagraphs"``), as its ``config.patch`` would refuse them."""
    from torch._inductor import config

    known = config._config  # type: ignore[attr-defined]
    return [name for name in names if name not in known]


def compile_fx(gm: torch.fx.GraphModule, inputs: Sequence[Any], options: Mapping[str, Any]) -> Any:
    """Inductor's compile of ``gm`` for ``inputs``, with compile_fx's keyword ``options``."""
    from torch._inductor.compile_fx import compile_fx as upstream

    return upstream(gm, inputs, **dict(options))


def serializable(compiled: Any) -> bool:
    """Whether inductor returned a compiled graph that upstream can serialize."""
    return hasattr(compiled, "serialize")


def serialize_variant(compiled: Any) -> bytes:
    """The payload bytes of a compiled graph (see the runtime's adapter)."""
    return runtime_adapter.serialize_variant(compiled)


def vec_isa() -> tuple[str, str]:
    """The vector ISA inductor builds C++ kernels for here, and its compiler flags."""
    return runtime_adapter.vec_isa()


def vec_isa_candidates() -> list[Any]:
    """The vector ISAs inductor's probe tries on this machine, as its ``valid_vec_isa_list``
    picks them (x86: those whose CPU flags the machine has; ``bool()`` of one compiles and
    loads a test program, once per process); none where it picks otherwise or this torch
    names them otherwise (its own probe then runs as it always does)."""
    import platform

    try:
        # imported here, in the calling thread: the probing threads then import nothing
        from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

        if sys.platform not in ("linux", "win32") or platform.machine() not in (
            "x86_64",
            "AMD64",
        ):
            return []
        flags = cpu_vec_isa.x86_isa_checker()
        return [
            isa
            for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())
        ]
    except (ImportError, AttributeError):
        return []


def cpp_kernel_files(calls: Sequence[tuple[Any, str]]) -> Iterator[str | None]:
    """For each ``(argtypes, source)`` of a wrapper's ``cpp_pybinding`` calls, the file
    inductor loaded the kernel from (None where it exposes none), one at a time. Inside
    the compile's inductor dir every kernel is already built: asking again compiles
    nothing."""
    from torch._inductor.async_compile import AsyncCompile

    async_compile = AsyncCompile()
    for argtypes, source in calls:
        function = async_compile.cpp_pybinding(argtypes, source)
        if hasattr(function, "result"):
            function = function.result()
        yield getattr(getattr(function, "__self__", None), "__file__", None)


# -- a payload: upstream's bundled AOTAutograd entry -------------------------------------
def unpickle_bundle(payload: bytes) -> tuple[Any, Any, Any]:
    """A payload's bundled entry, its kernels and constant arguments."""
    return runtime_adapter.unpickle_bundle(payload)


def pickle_bundle(entry: Any, kernels: Any, constant_args: Any) -> bytes:
    """The payload of a bundled entry, its kernels and constant arguments."""
    return pickle.dumps((entry, kernels, constant_args))


def forward_graph(entry: Any) -> Any:
    """The inductor CompiledFxGraph of a bundled entry's forward."""
    return runtime_adapter.forward_graph(entry)


def compiled_graphs(entry: Any) -> list[Any]:
    """A bundled entry's forward graph and, where it has one, its backward graph."""
    return runtime_adapter.compiled_graphs(entry)


def graph_source(graph: Any) -> str:
    """The generated wrapper module of a CompiledFxGraph."""
    return str(graph.source_code)


def wrapper_sources(payload: bytes) -> list[str]:
    """The generated wrapper module of every graph (forward, backward) in a payload."""
    entry, _, _ = unpickle_bundle(payload)
    return [graph_source(graph) for graph in compiled_graphs(entry)]


def input_writes(entry: Any) -> list[tuple[bool, bool]]:
    """Per flat input as AOTAutograd describes them: whether the graph writes its
    metadata (sizes, strides, storage), and whether it writes its data."""
    return [
        (
            bool(info.mutates_metadata or getattr(info, "mutates_storage_metadata", False)),
            bool(info.mutates_data),
        )
        for info in entry.runtime_metadata.input_info
    ]


def inputs_aliased_by_outputs(entry: Any) -> set[int]:
    """The flat inputs some output of the graph is (or is a view of)."""
    aliased: set[int] = set()
    for output in entry.runtime_metadata.output_info:
        if (
            output.output_type.name in ("alias_of_input", "is_input")
            and output.base_idx is not None
        ):
            aliased.add(int(output.base_idx))
    return aliased


# -- a compiled graph's Triton kernels ------------------------------------------------
class _TunedConfigNotBuilt(Exception):
    """The compile's autotuning chose a config that the saved kernel does not hold."""


def _raise_not_built() -> Any:
    raise _TunedConfigNotBuilt


def static_autotuners(graph: Any) -> list[Any]:
    """The autotuners of the statically launchable Triton kernels in a graph's bundle."""
    bundle = getattr(graph, "_triton_bundle", None)
    return list(getattr(bundle, "static_autotuners", None) or [])


def autotuner_name(autotuner: Any) -> str:
    """The name a graph's wrapper creates an autotuner under."""
    return str(autotuner.kernel_name)


def config_count(autotuner: Any) -> int:
    """How many configs an autotuner's kernel holds."""
    return len(autotuner.kernel.compile_results)


def keep_tuned_config(autotuner: Any) -> None:
    """Narrow an autotuner's kernel to the config autotuning in this inductor dir chose,
    where this torch can and the kernel holds that config (else nothing changes)."""
    recheck = getattr(autotuner.kernel, "recheck_autotune_cache", None)
    if recheck is not None:
        with contextlib.suppress(_TunedConfigNotBuilt):
            recheck(reload_kernel_from_src=_raise_not_built)


def fix_reduction_block(autotuner: Any) -> None:
    """Keep inductor from compiling smaller reduction blocks of a kernel at load."""
    kernel = autotuner.kernel
    kernel.inductor_meta = {**kernel.inductor_meta, "dynamic_scale_rblock": False}


# -- the lean path: a variant's wrapping, read --------------------------------------------
# What a generated wrapper module may import from torch's compiler on the lean path, the
# compiler's packages, and inductor's helpers a wrapper defines but never calls there.
LEAN_IMPORTS = runtime_adapter.LEAN_IMPORTS
COMPILER_PACKAGES = runtime_adapter._COMPILER_PACKAGES
UNCALLED_HELPERS = runtime_adapter._UNCALLED


@dataclass(frozen=True)
class Wrapping:
    """What AOTAutograd and inductor wrap around a variant's generated ``call`` at load,
    read off its bundled entry and forward graph (torch 2.10 to 2.13's fields)."""

    entry_type: str
    has_backward: bool
    has_subclasses: bool
    activation_inputs: bool
    functionalizes_rng: bool
    returns_rng_offset: bool
    effect_tokens: int
    writes_inputs_outside: bool  # inputs written by the runtime wrapper, not the graph
    aliased_outputs: int
    intermediate_bases: int
    changes_grad_mode: bool
    writes_on_streams: bool  # inputs written on user streams
    dispatch_wrappers: tuple[tuple[str, bool], ...]  # type name, needs post-compile
    graph_type: str
    device_types: frozenset[str]
    constants: bool
    torchbind_constants: bool
    wraps_regions: bool
    bundles_triton: bool
    inputs_to_check: tuple[Any, ...]  # inputs inductor checks the alignment of
    mutated_inputs: frozenset[Any]
    defers_input_alignment: bool


def wrapping(entry: Any, graph: Any) -> Wrapping:
    """A bundled entry's wrapping (``graph``: its forward graph)."""
    metadata = entry.runtime_metadata
    streams = getattr(metadata, "mutated_inp_stream_indices", None)
    bundle = getattr(graph, "_triton_bundle", None)
    return Wrapping(
        entry_type=type(entry).__name__,
        has_backward=getattr(entry, "compiled_bw", None) is not None,
        has_subclasses=getattr(entry, "maybe_subclass_meta", None) is not None,
        activation_inputs=bool(getattr(metadata, "act_input_indices", None)),
        functionalizes_rng=bool(metadata.is_rng_op_functionalized),
        returns_rng_offset=bool(getattr(metadata, "num_outputs_rng_offset", 0)),
        effect_tokens=len(metadata.tokens),
        writes_inputs_outside=bool(metadata.mutated_inp_runtime_indices),
        aliased_outputs=metadata.num_outputs_aliased,
        intermediate_bases=metadata.num_intermediate_bases,
        changes_grad_mode=metadata.grad_enabled_mutation is not None,
        writes_on_streams=not (streams in (None, []) or all(i is None for i in streams)),
        dispatch_wrappers=tuple(
            (type(w).__name__, bool(getattr(w, "needs_post_compile", False)))
            for w in getattr(entry, "dispatch_wrappers", None) or []
        ),
        graph_type=type(graph).__name__,
        device_types=frozenset(getattr(graph, "device_types", ())),
        constants=bool(getattr(graph, "constants", None)),
        torchbind_constants=bool(getattr(graph, "torchbind_constants", None)),
        wraps_regions=bool(getattr(graph, "_wrap_compiled_regions", False)),
        bundles_triton=bundle is not None
        and bool(getattr(bundle, "kernel_artifacts", 1) or getattr(bundle, "static_autotuners", 1)),
        inputs_to_check=tuple(getattr(graph, "inputs_to_check", ()) or ()),
        mutated_inputs=frozenset(getattr(graph, "mutated_input_idxs", ()) or ()),
        defers_input_alignment=bool(getattr(graph, "_defers_input_alignment", False)),
    )


def inference_version_bumps(entry: Any) -> tuple[int, ...]:
    """The inputs whose version AOTAutograd's inference wrapper bumps after a call (those
    the graph writes in place, where it keeps such writes in the graph)."""
    if not entry.sanitized_aot_config.keep_inference_input_mutations:
        return ()
    indices = entry.runtime_metadata.mutated_graph_handled_indices_seen_by_autograd
    return tuple(int(i) for i in indices)


def output_dynamic_dims(entry: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Per output that AOTAutograd's wrapper marks, the dims it marks dynamic."""
    metadata = entry.runtime_metadata
    if not metadata.dynamic_outputs:
        return ()
    return tuple(
        (index, tuple(sorted(int(d) for d in info.dynamic_dims)))
        for index, info in enumerate(metadata.output_info)
        if info.dynamic_dims is not None
    )


def output_count(entry: Any) -> int:
    """How many outputs a bundled entry's forward returns."""
    return int(entry.runtime_metadata.num_outputs)


def static_launcher_available() -> bool:
    """Whether this torch has its C++ launcher of Triton-compiled CUDA kernels."""
    return runtime_adapter.static_launcher() is not None


def extern_kernel(name: str) -> Any | None:
    """What ``extern_kernels.<name>`` is in this process (None where nothing)."""
    from torch._inductor.select_algorithm import extern_kernels

    return getattr(extern_kernels, name, None)


def op_path(value: Any) -> str | None:
    """``torch.ops.<ns>.<op>`` (``.<overload>``) naming an operator packet (overload),
    or None where ``value`` is neither."""
    if isinstance(value, torch._ops.OpOverloadPacket):
        namespace, _, op = value._qualified_op_name.partition("::")
        return f"torch.ops.{namespace}.{op}"
    if isinstance(value, torch._ops.OpOverload):
        namespace, _, op = value._overloadpacket._qualified_op_name.partition("::")
        return f"torch.ops.{namespace}.{op}.{value._overloadname}"
    return None


def extern_path_names(name: str, path: str) -> bool:
    """Whether ``path`` names the operator ``extern_kernels.<name>`` is (as a load checks)."""
    return runtime_adapter.extern_path_names(name, path)


def resolve_torch_path(path: str) -> Any:
    """The torch operator at a dotted path under ``torch`` (as a load resolves it)."""
    return runtime_adapter.resolve_torch_path(path)


def lean_support_mismatches() -> list[str]:
    """Where this torch's inductor differs from what the lean path's stand-ins repeat."""
    from torch._inductor import utils as inductor_utils
    from torch._inductor.codegen import memory_planning

    problems = []
    if getattr(inductor_utils, "ALIGN_BYTES", None) != runtime_adapter.LEAN_ALIGN_BYTES:
        problems.append("inductor's ALIGN_BYTES is not 64")
    if getattr(memory_planning, "_align", None) is not getattr(inductor_utils, "_align", 0):
        problems.append("inductor's _align is not its utils._align")
    if not runtime_adapter.cpp_loader_matches_inductor():
        problems.append("inductor's cpp_pybinding loader changed")
    return problems


def _global_names(function: Any) -> set[str]:
    """The global names a function's code, nested functions included, refers to."""
    names: set[str] = set()
    stack = [getattr(function, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return names


@functools.cache
def dynamic_dims_attribute() -> str | None:
    """The tensor attribute AOTAutograd's inference wrapper records outputs' dynamic dims
    in (``_dynamo_propagated_dynamic_indices`` in torch 2.13, ``_dynamo_weak_dynamic_indices``
    in 2.11): found by running the helper this torch's wrapper calls on a probe tensor."""
    import torch._dynamo  # runtime_wrappers imported first is a circular import
    from torch._functorch._aot_autograd import runtime_wrappers

    names = _global_names(runtime_wrappers._create_runtime_wrapper)
    names |= _global_names(getattr(runtime_wrappers, "_codegen_epilogue", None))
    helpers = [
        name
        for name in ("mark_dynamo_propagated_dynamic_indices", "maybe_mark_dynamic_helper")
        if name in names and callable(getattr(runtime_wrappers, name, None))
    ]
    if len(helpers) != 1:
        return None
    probe = torch.empty(0)
    getattr(runtime_wrappers, helpers[0])(probe, {0})
    found = [name for name, value in vars(probe).items() if value == {0}]
    return found[0] if len(found) == 1 and found[0].startswith("_dynamo_") else None


# -- the lean path on GPUs: what inductor launched, recorded -------------------------
def load_generated_module(source: str) -> Any:
    """Import a generated wrapper module as inductor does: its Triton kernels loaded
    through ``async_compile``, by the compile workers where they are up."""
    from torch._inductor.codecache import PyCodeCache

    return PyCodeCache.load(source)


@dataclass(frozen=True)
class RecordedLaunch:
    """A Triton kernel's launch as inductor performs it, and its binary."""

    launch: TritonLaunch
    binary: bytes


def _grid_assignment(line: str) -> tuple[str, str]:
    name, separator, expression = line.partition(" = ")
    if not separator or not name.isidentifier():
        raise ValueError(f"grid line {line!r} is not an assignment")
    return name, expression


def recorded_launch(module: Any, name: str) -> RecordedLaunch | str:
    """What inductor's autotuner ``name`` in a generated ``module`` launches once it ran
    (one launcher left): the static launcher's kernel, grid and arguments, rebuilt with
    the calls inductor's ``StaticTritonCompileResult.make_launcher`` makes and checked
    against the launcher it made. A string says why it cannot be recorded."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from torch._inductor.runtime.triton_heuristics import GridExpr

    autotuner = getattr(module, name, None)
    launchers = getattr(autotuner, "launchers", None)
    if not launchers or len(launchers) != 1:
        return f"Triton kernel {name} did not run down to one launcher at build time"
    (launcher,) = launchers
    if not getattr(launcher, "_is_static", False):
        return f"Triton kernel {name} is not launched statically (inductor's choice)"
    results = [r for r in getattr(autotuner, "compile_results", ()) if r.config is launcher.config]
    if len(results) != 1:
        return f"Triton kernel {name}'s launcher matches no single compile result"
    (result,) = results
    kernel = result.kernel
    try:
        _, parameters, none_args = result._get_arg_lists(
            kernel.arg_names, kernel.declared_constexprs
        )
        arguments = [
            arg
            for i, arg in enumerate(kernel.arg_names)
            if i not in kernel.full_constexprs and arg not in none_args
        ]
        grid = GridExpr.from_meta(result.inductor_meta, result.config)
        prefix = tuple(_grid_assignment(line) for line in grid.prefix)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        return f"Triton kernel {name}'s launcher could not be rebuilt ({type(exc).__name__})"
    code = launcher.__code__
    if list(code.co_varnames[: code.co_argcount]) != [*parameters, "stream"]:
        return f"Triton kernel {name}'s launcher takes other parameters than rebuilt"
    scratch = int(bool(kernel.has_global_scratch)) + int(bool(kernel.has_profile_scratch))
    if len(arguments) != len(kernel.arg_tys):
        return f"Triton kernel {name} passes {len(arguments)} arguments for {kernel.arg_tys!r}"
    device = result.compile_meta.get("device", 0) or 0
    # The file the launcher was made from; else where Triton's cache keeps it here.
    path = getattr(kernel, "cubin_path", None) or os.path.join(
        triton_cache_dir(device), launcher.cache_hash, f"{kernel.name}.cubin"
    )
    try:
        with open(path, "rb") as file:
            binary = file.read()
    except OSError:
        return f"Triton kernel {name}'s binary is not in Triton's cache ({path})"
    launch = TritonLaunch(
        name=name,
        function=kernel.name,
        binary=sha256_hex(binary),
        device=int(device),
        num_warps=int(kernel.num_warps),
        shared=int(kernel.shared),
        arg_types=kernel.arg_tys + "O" * scratch,
        parameters=tuple(parameters),
        grid_prefix=prefix,
        grid=(str(grid.x_grid), str(grid.y_grid), str(grid.z_grid)),
        arguments=tuple(arguments),
        scratch=scratch,
    )
    return RecordedLaunch(launch, binary)


# -- the compiler's configs -------------------------------------------------------------
# -- a graph and its timings across processes (``_variant_workers``) ------------------
def graph_to_bytes(gm: torch.fx.GraphModule) -> bytes:
    """``gm`` pickled with its nodes' metadata (their fake example values, which
    AOTAutograd's cache reads) by torch's ``GraphPickler``, less what refers to real
    tensors; a view's base is described without its fake mode, which torch's pickler
    leaves on it (and then fails on)."""
    import dataclasses
    import io

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx import _graph_pickler

    class _Pickler(_graph_pickler.GraphPickler):  # type: ignore[misc]
        def reducer_override(self, obj: object) -> Any:
            if not isinstance(obj, FakeTensor):
                return super().reducer_override(obj)
            unpickle, (data, state) = _graph_pickler._TensorPickleData.reduce_helper(self, obj)
            base = data.metadata.base
            if base is not None:
                data.metadata = dataclasses.replace(
                    data.metadata, base=dataclasses.replace(base, fake_mode=None)
                )
            return unpickle, (data, state)

    def kept(key: str) -> bool:
        # Dynamo's record of each placeholder's argument (``grapharg``) refers to the
        # caller's real tensor, its parameters included: a compile from fresh inputs
        # reads none of it
        return key != "grapharg" and _graph_pickler._node_metadata_key_filter_safe(key)

    options = _graph_pickler.Options(node_metadata_key_filter=kept)
    with io.BytesIO() as stream:
        _Pickler(stream, options).dump(gm)
        return stream.getvalue()


def graph_from_bytes(data: bytes) -> torch.fx.GraphModule:
    """A graph ``graph_to_bytes`` wrote, its fake values in a fresh fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"expected a pickled GraphModule, got {type(gm).__name__}")
    return gm


@contextmanager
def gpu_timings_under(lock: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Every GPU timing inductor takes (autotuning's) holds ``lock()`` for the duration:
    processes compiling on one GPU time their kernels one at a time, as one process
    would, instead of each other's kernels too."""
    from torch._inductor.runtime import benchmarking

    timer = benchmarking.benchmarker
    original = timer.benchmark_gpu
    own = "benchmark_gpu" in vars(timer)

    def locked(*args: Any, **kwargs: Any) -> Any:
        with lock():
            return original(*args, **kwargs)

    timer.benchmark_gpu = locked
    try:
        yield
    finally:
        if own:
            timer.benchmark_gpu = original
        else:
            del timer.benchmark_gpu  # the class's method again


def set_config_values(name: str, values: Mapping[str, Any]) -> None:
    """Set entries of the config module ``name`` (``CONFIG_MODULES``) for this process."""
    import importlib

    config = importlib.import_module(name)
    for key, value in values.items():
        setattr(config, key, value)


CONFIG_MODULES = ("torch._inductor.config", "torch._functorch.config")
INDUCTOR_CONFIG = "torch._inductor.config"
# a name of an environment variable, as a config module's source spells it
_ENV_NAME = re.compile(r"""["']([A-Z][A-Z0-9_]{2,127})["']""")


def config_values(config: Any) -> dict[str, Any]:
    """A config module's portable entries, by value (as ``save_config_portable`` exports
    them)."""
    return config.save_config_portable()  # type: ignore[no-any-return]


def config_defaults(config: Any) -> dict[str, Any] | None:
    """The defaults of a config module's entries that say theirs (None where this torch's
    config module says none)."""
    entries = getattr(config, "_config", None)
    if not isinstance(entries, dict):
        return None
    return {key: entry.default for key, entry in entries.items() if hasattr(entry, "default")}


def config_environment_names() -> set[str]:
    """Every environment variable name the config modules' source spells as a string
    (read from torch's files, without importing the modules; a file that cannot be
    read is a name of its own, ``<_inductor/config.py unreadable>``)."""
    names: set[str] = set()
    root = os.path.dirname(torch.__file__)
    for relative in ("_inductor/config.py", "_functorch/config.py"):
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as file:
                names.update(_ENV_NAME.findall(file.read()))
        except OSError:
            names.add(f"<{relative} unreadable>")
    return names
