"""Every private torch API the compile side touches (Dynamo, Inductor, ShapeEnv, sympy).

A variant is compiled from a fresh ShapeEnv whose symbols mirror the caller's, with
their backed hints set to the variant's point. The caller's ShapeEnv is never handed to
Inductor, so guards that one variant's compile adds stay with that variant.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import pickle
import platform
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from precompile.cache import sha256_hex
from precompile.runtime import (
    InvalidOptionError,
    LeanCall,
    NativeKernel,
    TritonLaunch,
    UnsupportedGraphError,
    build_dir,
    cpu_features_for_flags,
    find_cpp_kernels,
)
from precompile.runtime import _torch_adapter as runtime_adapter
from precompile.runtime import native_kernel_key as kernel_key

from ._attention_policy import key_factor as attention_key_factor
from ._attention_policy import sdpa_backends
from ._graph import GraphDescription, GraphInput

log = logging.getLogger("precompile.compile")

DYNAMIC_SHAPES = ("from_graph", "from_tracing_context", "from_example_inputs")


@functools.cache
def upstream_standalone_parameters() -> frozenset[str]:
    """The keyword arguments the installed torch's ``standalone_compile`` takes (2.10 and
    2.11 lack ``donate_graph_module`` and ``fake_mode``, 2.13 has both)."""
    from torch._inductor import standalone_compile as upstream

    return frozenset(inspect.signature(upstream).parameters)


def check_upstream_fake_mode(fake_mode: Any, dynamic_shapes: str) -> None:
    """Refuse a ``fake_mode`` where upstream refuses it, with upstream's reasons."""
    if fake_mode is None:
        return
    if dynamic_shapes != "from_example_inputs":
        raise InvalidOptionError(
            "standalone_compile only supports passing `fake_mode` when "
            f'`dynamic_shapes="from_example_inputs"`, got dynamic_shapes={dynamic_shapes!r}'
        )
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(fake_mode, FakeTensorMode):
        raise InvalidOptionError(
            f"fake_mode must be a FakeTensorMode, got {type(fake_mode).__name__}"
        )
    if fake_mode.shape_env is None:
        raise InvalidOptionError(
            "standalone_compile requires `fake_mode` to have a ShapeEnv when "
            '`dynamic_shapes="from_example_inputs"`'
        )


# -- reading the caller's graph ----------------------------------------------------------
def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Dynamo's ``mark_dynamic``: trace ``dim`` of ``tensor`` as a symbol."""
    torch._dynamo.mark_dynamic(tensor, dim)


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask Dynamo to trace ``dim`` of ``tensor`` as a symbol without ``mark_dynamic``'s
    constraints: dims found equal to each other (``input_ids`` and ``position_ids``
    lengths) share one symbol, where torch 2.11 fails the trace; the caller checks
    afterwards that each dim did become a symbol."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _resolve_fake_mode(gm: torch.fx.GraphModule, dynamic_shapes: str) -> Any | None:
    if dynamic_shapes == "from_example_inputs":
        return None
    if dynamic_shapes == "from_tracing_context":
        context = torch._guards.TracingContext.try_get()
        if context is None or context.fake_mode is None:
            raise InvalidOptionError(
                "dynamic_shapes='from_tracing_context' needs an active tracing context "
                "(call it from inside a torch.compile backend)"
            )
        return context.fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    for node in reversed(gm.graph.nodes):
        if node.op != "output":
            continue
        outputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        for out in outputs:
            value = getattr(out, "meta", {}).get("example_value", None)
            if value is None:
                value = getattr(out, "meta", {}).get("val", None)
            if isinstance(value, FakeTensor):
                return value.fake_mode
    return None


def _placeholder_values(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise InvalidOptionError(
            f"example_inputs has {len(example_inputs)} entries but the graph has "
            f"{len(placeholders)} placeholders"
        )
    values = []
    for node, example in zip(placeholders, example_inputs, strict=True):
        meta = node.meta.get("example_value", node.meta.get("val"))
        values.append(meta if meta is not None else example)
    return values


def _entry_requires_grad(value: Any, example: Any) -> bool:
    """Whether a graph input requires grad as the graph is entered: the example tensor's
    flag (a backend gets the real tensors before the frame runs). The placeholder's fake
    tensor is what tracing left: an in-place write of a value that requires grad (a KV
    cache filled from the projections, grad enabled) set its flag, which the tensor a
    call passes does not have. The fake is read only where the example is no tensor."""
    return bool((example if isinstance(example, torch.Tensor) else value).requires_grad)


def _expr(value: Any, shape_env: Any | None) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        if shape_env is not None and value.node.shape_env is shape_env:
            expr = shape_env.replace(expr)
        return sympy.sympify(expr)
    return sympy.Integer(int(value))


def _hint(shape_env: Any, symbol: sympy.Symbol) -> int:
    table = getattr(shape_env, "backed_var_to_val", None)
    if table is None:
        table = shape_env.var_to_val
    if symbol not in table:
        raise UnsupportedGraphError(
            f"symbol {symbol} has no hint (unbacked symbols are not supported as inputs)"
        )
    return int(table[symbol])


def _range(shape_env: Any, symbol: sympy.Symbol) -> tuple[int, int | None]:
    bounds = shape_env.var_to_range.get(symbol)
    if bounds is None:
        return 0, None
    low = int(bounds.lower) if bounds.lower.is_Integer else 0
    high = int(bounds.upper) if bounds.upper.is_Integer else None
    # Dynamo's lower bound of 2 only reflects its 0/1 specialization; variants are compiled
    # without that assumption (their own guards say what they need), so sizes 0/1 stay open.
    if low == 2:
        low = 0
    return low, high


def describe_graph(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], dynamic_shapes: str
) -> GraphDescription:
    """Read the caller's graph once, into plain data the rest of the compile side uses:
    each flat input's dtype, device, symbolic shape and strides, the symbols with their
    hints and ranges, the floats Dynamo lifted, and the output structure. Nothing here
    mutates the caller's graph or ShapeEnv."""
    fake_mode = _resolve_fake_mode(gm, dynamic_shapes)
    shape_env = getattr(fake_mode, "shape_env", None)
    if dynamic_shapes == "from_example_inputs":
        values = list(example_inputs)
    else:
        values = _placeholder_values(gm, example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    table_rows = _embedding_rows(gm, placeholders)
    inputs: list[GraphInput] = []
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            if dynamic_shapes == "from_example_inputs":
                shape = tuple(sympy.Integer(int(s)) for s in value.shape)
                stride = tuple(sympy.Integer(int(s)) for s in value.stride())
                offset: sympy.Expr = sympy.Integer(int(value.storage_offset()))
            else:
                env = shape_env or _env_of(value)
                shape = tuple(_expr(s, env) for s in value.shape)
                stride = tuple(_expr(s, env) for s in value.stride())
                offset = _expr(value.storage_offset(), env)
            scalar, scalar_symbol = _float_scalar(value, example_inputs[index])
            static_address = _static_address(placeholders, index, example_inputs)
            inputs.append(
                GraphInput(
                    "tensor",
                    dtype=value.dtype,
                    device=value.device,
                    requires_grad=_entry_requires_grad(value, example_inputs[index]),
                    shape=shape,
                    stride=stride,
                    storage_offset=offset,
                    scalar=scalar,
                    scalar_symbol=scalar_symbol,
                    static_address=static_address,
                    index_rows=table_rows.get(index),
                    name=_input_name(placeholders, index),
                )
            )
        elif isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            name = _input_name(placeholders, index)
            if dynamic_shapes == "from_example_inputs":
                inputs.append(GraphInput("int", value=sympy.Integer(int(value)), name=name))
            else:
                size = _expr(value, shape_env or _env_of(value))
                inputs.append(GraphInput("int", value=size, name=name))
        else:
            raise UnsupportedGraphError(
                f"graph input {index} is a {type(value).__name__}; precompile supports tensor "
                "and int inputs"
            )
    symbols: dict[sympy.Symbol, None] = {}
    for item in inputs:
        # Storage offsets are not read from a call (only static ones are checked), so a
        # symbol appearing only there is not a size the variants dispatch on.
        exprs = (*item.shape, *item.stride, item.value)
        for expr in exprs:
            for symbol in sorted(expr.free_symbols, key=str):
                symbols.setdefault(symbol)
    if symbols and shape_env is None:
        shape_env = _first_env(values)
    hints = {s: _hint(shape_env, s) for s in symbols}
    ranges = {s: _range(shape_env, s) for s in symbols}
    return GraphDescription(
        tuple(inputs),
        tuple(symbols),
        hints,
        ranges,
        shape_env,
        _output_spec(gm),
        _output_shapes(gm, shape_env),
        _caller_guards(shape_env, set(symbols)),
    )


def _caller_guards(shape_env: Any | None, symbols: set[sympy.Symbol]) -> tuple[sympy.Expr, ...]:
    """The guards the caller's trace recorded on the graph's sizes: a Python branch that
    Dynamo decided from a size (``if x.shape[0] % 2 == 0``), which no range says."""
    if shape_env is None or not symbols:
        return ()
    found: dict[sympy.Expr, None] = {}
    for guard in getattr(shape_env, "guards", ()):
        expr = sympy.sympify(shape_env.replace(guard.expr))
        if expr is sympy.true or not expr.free_symbols:
            continue
        if expr.free_symbols <= symbols:
            found.setdefault(expr)
        else:
            log.debug("caller guard %s names sizes that are no graph input: not kept", expr)
    return tuple(found)


def _output_shapes(
    gm: torch.fx.GraphModule, shape_env: Any | None
) -> tuple[tuple[sympy.Expr, ...] | None, ...] | None:
    """Each flat output's symbolic shape, from the output node's fake values."""
    from torch.utils import _pytree as pytree

    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if output is None:
        return None
    shapes: list[tuple[sympy.Expr, ...] | None] = []
    for node in pytree.tree_leaves(output.args[0]):
        value = getattr(node, "meta", {}).get("example_value", getattr(node, "meta", {}).get("val"))
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(_expr(s, shape_env or _env_of(s)) for s in value.shape))
        else:
            shapes.append(None)
    return tuple(shapes)


def with_static_mark(original: torch.Tensor, copied: torch.Tensor) -> torch.Tensor:
    """``copied`` with Dynamo's static-address mark where ``original`` has one
    (transformers marks a StaticCache's tensors: a graph writes them in place, and a
    CUDA graph replays on them only while they keep one address)."""
    mark = getattr(original, "_dynamo_static_input_type", None)
    if mark is not None:
        copied._dynamo_static_input_type = mark  # type: ignore[attr-defined]
    return copied


def _input_name(placeholders: Sequence[Any], index: int) -> str | None:
    """What input ``index`` is in the caller's code: Dynamo's source of it (``L['x']``,
    ``L['self']._modules['fc']._parameters['weight']``), else the placeholder's name."""
    if index >= len(placeholders):
        return None
    node = placeholders[index]
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    text = name if isinstance(name, str) and name else str(node.target)
    return text[:200]


def _static_address(placeholders: Sequence[Any], index: int, examples: Sequence[Any]) -> bool:
    """Whether Dynamo marked input ``index`` static (parameters and buffers of modules)."""
    example = examples[index] if index < len(examples) else None
    if getattr(example, "_dynamo_static_input_type", None) is not None:
        return True
    if isinstance(example, torch.nn.Parameter):
        return True
    if index < len(placeholders):
        meta = placeholders[index].meta.get("tensor_dict", {})
        return meta.get("_dynamo_static_input_type") is not None
    return False


def _float_scalar(value: Any, example: Any) -> tuple[float | None, Any]:
    """The float a 0-d tensor input stands for, if Dynamo made it of a Python float
    (its fake carries the SymFloat ``item()`` returns), and that SymFloat."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not (isinstance(value, FakeTensor) and value.dim() == 0 and value.dtype.is_floating_point):
        return None, None
    memo = value.item_memo
    if not isinstance(memo, torch.SymFloat):
        return None, None
    if isinstance(example, torch.Tensor) and not isinstance(example, FakeTensor):
        return float(example.item()), memo
    hint = memo.node.hint
    if hint is None:
        raise UnsupportedGraphError("a float input has no value to specialize the variants to")
    return float(hint), memo


def _output_spec(gm: torch.fx.GraphModule) -> str | None:
    """Upstream's pytree spec of the graph's output where compile_fx flattens it (a single
    value, as ``split_module`` submodules return, or a dict): the artifact rebuilds it."""
    from torch._inductor.compile_fx import graph_returns_tuple
    from torch.utils import _pytree as pytree

    if graph_returns_tuple(gm):
        return None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    _, spec = pytree.tree_flatten(output.args[0])
    return str(pytree.treespec_dumps(spec))


def specialize_caller_float(symbol: Any) -> None:
    """Pin a caller's SymFloat to its value (Dynamo then guards on it, and recompiles
    for another value instead of calling variants specialized to this one)."""
    float(symbol)


def _env_of(value: Any) -> Any | None:
    if isinstance(value, torch.SymInt):
        return value.node.shape_env
    fake_mode = getattr(value, "fake_mode", None)
    return getattr(fake_mode, "shape_env", None)


def _first_env(values: Sequence[Any]) -> Any:
    for value in values:
        env = _env_of(value)
        if env is None and isinstance(value, torch.Tensor):
            for size in value.shape:
                env = _env_of(size)
                if env is not None:
                    break
        if env is not None:
            return env
    raise UnsupportedGraphError("graph has symbolic sizes but no ShapeEnv could be found")


# -- compiling one variant -----------------------------------------------------------
@dataclass(frozen=True)
class InputUse:
    """What the compiled graph does with one flat input (from AOTAutograd's analysis)."""

    mutation: str  # "none" | "data" | "metadata"
    aliased: bool  # some output is a view of it (or is it)


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
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv(specialize_zero_one=False, duck_shape=False)
    fake_mode = FakeTensorMode(shape_env=shape_env)
    mapping: dict[sympy.Symbol, sympy.Expr] = {}
    for symbol in graph.symbols:
        if dynamic:
            mapping[symbol] = shape_env.create_symbol(
                point[symbol],
                source=ConstantSource(f"precompile_{symbol}"),
                dynamic_dim=DimDynamic.DYNAMIC,
            )
        else:
            mapping[symbol] = sympy.Integer(point[symbol])

    def concrete(expr: sympy.Expr) -> Any:
        new = sympy.sympify(expr).xreplace(mapping)
        if new.is_Integer:
            return int(new)
        hint = int(sympy.sympify(expr).xreplace({s: point[s] for s in graph.symbols}))
        return shape_env.create_symintnode(new, hint=hint)

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
            # item() of this input returns the constant (a SymFloat with a hint, which the
            # fake tensor keeps across retraces): the variant is specialized to it.
            tensor.item_memo = torch.SymFloat(
                SymNode(sympy.Float(item.scalar), shape_env, float, hint=item.scalar)
            )
        values.append(tensor)
    reverse = {new: old for old, new in mapping.items() if isinstance(new, sympy.Symbol)}
    return values, fake_mode, reverse


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


def wrapper_sources(payload: bytes) -> list[str]:
    """The generated wrapper module of every graph (forward, backward) in a payload."""
    entry, _, _ = runtime_adapter.unpickle_bundle(payload)
    return [str(graph.source_code) for graph in runtime_adapter.compiled_graphs(entry)]


def variant_code_digest(payload: bytes) -> str:
    """sha256 over the generated code (forward, and backward if any): equal means same code."""
    digest = hashlib.sha256()
    for number, source in enumerate(wrapper_sources(payload)):
        digest.update((b"\0backward\0" if number else b"") + source.encode())
    return digest.hexdigest()


def _pinned_to_a_size(shape_env: Any, symbols: Mapping[Any, Any]) -> bool:
    """Whether a compile replaced one of the variant's symbols by a constant."""
    return any(
        symbol in symbols and sympy.sympify(value).is_Integer
        for symbol, value in shape_env.replacements.items()
    )


@contextmanager
def _compile_context(fake_mode: Any, size_oblivious: bool) -> Iterator[None]:
    """Inductor's settings for one variant's compile. ``size_oblivious``: answer 0/1
    questions about sizes (is this dim broadcast?) for every size instead of guarding
    them at the hint, so a variant hinted at 8 also serves 1 (vLLM decodes at 1 token
    through the artifact it compiled for a range traced at a larger size)."""
    import torch._functorch.config as functorch_config
    import torch.fx.experimental._config as shape_config
    from torch._inductor import config as inductor_config

    patches: dict[str, Any] = {"bundled_autograd_cache": True}
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        patches["force_non_lazy_backward_lowering"] = True
    build = build_dir()
    with ExitStack() as stack:
        stack.enter_context(inductor_cache_dir(build))
        # Variants of one graph share an AOTAutograd key; drop earlier entries so a later
        # variant is compiled for its own hints instead of reusing an earlier one's code.
        shutil.rmtree(os.path.join(build, "aotautograd"), ignore_errors=True)
        stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(fake_mode)))
        stack.enter_context(inductor_config.patch("triton.autotune_at_compile_time", True))
        stack.enter_context(functorch_config.patch(patches))
        if size_oblivious:
            stack.enter_context(shape_config.patch(backed_size_oblivious=True))
        yield


def _embedding_rows(gm: torch.fx.GraphModule, placeholders: Sequence[Any]) -> dict[int, int]:
    """Per placeholder (by position) used directly as an embedding's indices, the rows of
    the smallest table it indexes (a static size), whose range a call's values must keep."""
    position = {node: index for index, node in enumerate(placeholders)}
    rows: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.nn.functional.embedding:
            indices = node.args[0] if node.args else node.kwargs.get("input")
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        elif node.target is torch.ops.aten.embedding.default:
            weight, indices = node.args[0], node.args[1]
        else:
            continue
        if indices not in position or not isinstance(weight, torch.fx.Node):
            continue
        table = weight.meta.get("example_value", weight.meta.get("val"))
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            continue
        size = table.shape[0]
        if isinstance(size, int):
            index = position[indices]
            rows[index] = min(size, rows.get(index, size))
    return rows


def sdpa_switches() -> dict[str, bool]:
    """The caller's scaled-dot-product-attention backend switches (``torch.backends.cuda``)."""
    backends = torch.backends.cuda
    return {
        "flash": backends.flash_sdp_enabled(),
        "mem_efficient": backends.mem_efficient_sdp_enabled(),
        "math": backends.math_sdp_enabled(),
        "cudnn": backends.cudnn_sdp_enabled(),
    }


_SDPA_TARGETS = (
    torch._C._nn.scaled_dot_product_attention,
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


def attention_lengths(gm: torch.fx.GraphModule) -> tuple[sympy.Expr, ...] | None:
    """The query and key lengths (dim -2) of every scaled-dot-product-attention call in
    ``gm``, in the trace's symbols; None where one cannot be read."""
    lengths: list[sympy.Expr] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        for index, name in ((0, "query"), (1, "key")):
            arg = node.args[index] if len(node.args) > index else node.kwargs.get(name)
            value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                return None
            size = value.shape[-2]
            symbolic = isinstance(size, torch.SymInt)
            lengths.append(size.node.expr if symbolic else sympy.Integer(size))
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
        bounds = shape_env.bound_sympy(shape_env.replace(expr))
        if not (bounds.lower.is_Integer and bounds.lower == bounds.upper):
            return False
    return True


@contextmanager
def _attention_backends(settings: Mapping[str, bool]) -> Iterator[None]:
    """Set the SDPA backend switches (process-wide, as torch keeps them) for a compile:
    AOTAutograd picks the fused attention kernel while it traces, by these switches."""
    backends = torch.backends.cuda
    switches = {
        "flash": (backends.flash_sdp_enabled, backends.enable_flash_sdp),
        "mem_efficient": (backends.mem_efficient_sdp_enabled, backends.enable_mem_efficient_sdp),
        "math": (backends.math_sdp_enabled, backends.enable_math_sdp),
        "cudnn": (backends.cudnn_sdp_enabled, backends.enable_cudnn_sdp),
    }
    before = {name: read() for name, (read, _) in switches.items()}
    try:
        for name, value in settings.items():
            switches[name][1](value)
        yield
    finally:
        for name, value in before.items():
            switches[name][1](value)


# Triton cuts its cache files' names to 150 characters, while inductor looks a kernel's
# cubin up under the kernel's full name: a longer name (inductor names fused kernels after
# every op they fuse) is not statically launchable, and loading it builds Triton's C
# launcher with gcc. Fused names are cut so that every kernel name stays under 150.
FUSED_NAME_LIMIT = 100


class _ShortKernelNames:
    """The current InductorChoices, with fused kernel names cut to ``FUSED_NAME_LIMIT``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def customize_fused_kernel_name(self, fused_name: str, src_code: str) -> str:
        name = str(self._inner.customize_fused_kernel_name(fused_name, src_code))
        return name[:FUSED_NAME_LIMIT]


@contextmanager
def _short_kernel_names() -> Iterator[None]:
    from torch._inductor import config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    if hasattr(InductorChoices, "customize_fused_kernel_name"):
        with V.set_choices_handler(_ShortKernelNames(V.choices)):
            yield
    else:  # a torch without the naming hook: plain numbered names
        with inductor_config.patch({"triton.descriptive_names": False}):
            yield


_TRITON_CALL = re.compile(r"^\w+ = async_compile\.triton\('(\w+)'", re.M)


class _TunedConfigNotBuilt(Exception):
    """The compile's autotuning chose a config that the saved kernel does not hold."""


def _raise_not_built() -> Any:
    raise _TunedConfigNotBuilt


def _settle_triton_kernels(payload: bytes) -> bytes:
    """Fix each statically launchable Triton kernel of the payload to the config this
    compile's autotuning chose, so that a load neither benchmarks configs at the first
    call nor compiles smaller reduction blocks (Triton's driver, gcc and ptxas would run);
    warn about kernels that need Triton's own launcher (built with gcc at load).

    Runs inside the compile's inductor dir, where the autotuning results are."""
    if b"async_compile.triton(" not in payload:
        return payload
    entry, kernels, constant_args = runtime_adapter.unpickle_bundle(payload)
    for graph in runtime_adapter.compiled_graphs(entry):
        bundle = getattr(graph, "_triton_bundle", None)
        static = list(getattr(bundle, "static_autotuners", None) or [])
        for autotuner in static:
            kernel = autotuner.kernel
            recheck = getattr(kernel, "recheck_autotune_cache", None)
            if len(kernel.compile_results) > 1 and recheck is not None:
                with contextlib.suppress(_TunedConfigNotBuilt):
                    recheck(reload_kernel_from_src=_raise_not_built)
            if len(kernel.compile_results) == 1:
                kernel.inductor_meta = {**kernel.inductor_meta, "dynamic_scale_rblock": False}
            else:
                log.info(
                    "Triton kernel %s keeps %d configs: its first call in a process "
                    "benchmarks them",
                    autotuner.kernel_name,
                    len(kernel.compile_results),
                )
        launched = set(_TRITON_CALL.findall(str(graph.source_code)))
        unsettled = sorted(launched - {a.kernel_name for a in static})
        if unsettled:
            log.warning(
                "%d Triton kernel(s) cannot be launched without Triton's own launcher, which "
                "a load builds with gcc: %s",
                len(unsettled),
                ", ".join(unsettled)[:500],
            )
    return pickle.dumps((entry, kernels, constant_args))


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
    from torch._inductor.compile_fx import compile_fx

    inputs, fake_mode, reverse = _fresh_inputs(graph, point, dynamic)
    with (
        _compile_context(fake_mode, size_oblivious),
        _attention_backends(attention),
        _short_kernel_names(),
    ):
        compiled = compile_fx(copy.deepcopy(gm), inputs, **dict(options))
        if not hasattr(compiled, "serialize"):
            raise UnsupportedGraphError(
                "inductor returned a compiled graph that cannot be serialized (for example "
                "a graph with no operations, or options such as freezing that upstream "
                "cannot save)"
            )
        try:
            payload = runtime_adapter.serialize_variant(compiled)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise UnsupportedGraphError(
                "inductor compiled the graph but could not serialize it "
                f"({type(exc).__name__}: {exc}); graphs from torch.export's module() wrapper "
                "are one known case: capture the graph with Dynamo (a torch.compile backend) "
                "instead"
            ) from exc
        payload = _settle_triton_kernels(payload)
        kernels = _built_cpp_kernels(payload)
        uses, training = _input_uses(payload, len(inputs))
    return fake_mode, reverse, payload, kernels, uses, training


def compile_variant(
    gm: torch.fx.GraphModule,
    graph: GraphDescription,
    point: Mapping[sympy.Symbol, int],
    *,
    dynamic: bool,
    options: Mapping[str, Any],
) -> CompiledVariant:
    """Compile one variant with inductor from a fresh ShapeEnv whose symbols mirror the
    caller's, hinted at ``point`` (``dynamic=False``: fixed to it), so the guards this
    compile adds are this variant's alone; returns its payload, those guards in the
    caller's symbols, its built C++ kernels and how it uses its inputs."""
    # A point at 0 or 1 is meant to specialize (a decode step's code for one row); any
    # other dynamic point is traced for every size, 0 and 1 included. Size-oblivious
    # tracing is experimental in torch: where it fails (torch 2.11 lowering a KV-cache
    # graph raised KeyError 'unbacked_bindings'), the variant is compiled with 0/1 guards
    # instead, which keep it away from the sizes it was not traced for.
    size_oblivious = dynamic and all(int(v) >= 2 for v in point.values())
    switches = sdpa_switches()
    lengths = attention_lengths(gm) if dynamic else ()
    # cuDNN attention is allowed where every attention length can be fixed in this
    # variant (each symbol in them at 0 or 1, which a size-oblivious compile never has);
    # the compile's guards confirm it below.
    may_fix = (
        graph_on_cuda(graph)
        and lengths is not None
        and all(
            int(point.get(symbol, 2)) <= 1 for length in lengths for symbol in length.free_symbols
        )
    )
    attention = sdpa_backends(switches, dynamic=dynamic, lengths_fixed=may_fix)
    retry: str | None = None
    try:
        result = _compile_once(gm, graph, point, dynamic, options, size_oblivious, attention)
    except UnsupportedGraphError:
        raise
    except Exception as exc:
        if not size_oblivious or not type(exc).__module__.startswith("torch"):
            raise  # only torch's own compile failures are worth a guarded retry
        first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        retry = f"size-oblivious compile failed ({type(exc).__name__}: {first_line})"
    else:
        if size_oblivious and _pinned_to_a_size(result[0].shape_env, result[1]):
            # Seen with a backward graph of masked attention: size-oblivious tracing held
            # the dim to its hint (12 == s); traced with 0/1 guards it serves every size.
            retry = "size-oblivious compile held a dynamic dim to one size"
    if retry is not None:
        log.info("%s; compiling with 0/1 guards", retry)
        result = _compile_once(gm, graph, point, dynamic, options, False, attention)
    unfixed = sdpa_backends(switches, dynamic=dynamic, lengths_fixed=False)
    if attention != unfixed and not _lengths_pinned(result[0].shape_env, result[1], lengths or ()):
        log.info("an attention length stays free in this variant; compiling it without cuDNN")
        result = _compile_once(gm, graph, point, dynamic, options, False, unfixed)
    elif attention != unfixed and lengths:
        log.info("variant at %s: attention lengths fixed, compiled with cuDNN allowed", point)
    fake_mode, reverse, payload, kernels, uses, training = result
    shape_env = fake_mode.shape_env
    guards: list[sympy.Expr] = [g.expr for g in shape_env.guards]
    for symbol, replacement in shape_env.replacements.items():
        if symbol in reverse:
            guards.append(sympy.Eq(symbol, replacement))
    for symbol in reverse:
        bounds = shape_env.var_to_range.get(symbol)
        if bounds is not None and bounds.lower.is_Integer and int(bounds.lower) > 0:
            guards.append(sympy.Ge(symbol, int(bounds.lower)))
        if bounds is not None and bounds.upper.is_Integer:
            guards.append(sympy.Le(symbol, int(bounds.upper)))
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
                expr = sympy.simplify(expr.xreplace({s: _hint(shape_env, s) for s in leftover}))
        if expr.free_symbols - set(graph.symbols):
            raise UnsupportedGraphError(
                f"variant guard {guard} involves symbols that are not graph inputs"
            )
        if expr is sympy.true:
            continue
        translated.append(expr)
    return CompiledVariant(payload, tuple(dict.fromkeys(translated)), kernels, uses, training)


def _input_uses(payload: bytes, count: int) -> tuple[tuple[InputUse, ...], bool]:
    """Per flat input, whether the graph writes it and whether an output aliases it; and
    whether a backward graph was compiled."""
    entry, _, _ = runtime_adapter.unpickle_bundle(payload)
    metadata = entry.runtime_metadata
    infos = list(metadata.input_info)
    if len(infos) != count:
        raise UnsupportedGraphError(
            f"AOTAutograd describes {len(infos)} inputs of a graph with {count}; cannot tell "
            "which inputs it writes"
        )
    aliased: set[int] = set()
    for output in metadata.output_info:
        if (
            output.output_type.name in ("alias_of_input", "is_input")
            and output.base_idx is not None
        ):
            aliased.add(int(output.base_idx))
    uses = []
    for index, info in enumerate(infos):
        if info.mutates_metadata or getattr(info, "mutates_storage_metadata", False):
            mutation = "metadata"
        elif info.mutates_data:
            mutation = "data"
        else:
            mutation = "none"
        uses.append(InputUse(mutation, index in aliased))
    training = len(runtime_adapter.compiled_graphs(entry)) > 1
    return tuple(uses), training


def _built_cpp_kernels(payload: bytes) -> tuple[tuple[NativeKernel, bytes], ...]:
    """Each C++ kernel the payload's wrappers build, with the ``.so`` this compile built.

    Runs inside the compile's inductor dir, where every kernel is already built, so
    asking inductor for it again returns the loaded module without compiling.
    """
    from torch._inductor.async_compile import AsyncCompile

    sources = wrapper_sources(payload)
    calls = [kernel for source in sources for kernel in find_cpp_kernels(source)]
    if not calls:
        return ()
    isa, flags = runtime_adapter.vec_isa()
    async_compile = AsyncCompile()
    built = []
    for argtypes, source in calls:
        function = async_compile.cpp_pybinding(argtypes, source)
        if hasattr(function, "result"):
            function = function.result()
        path = getattr(getattr(function, "__self__", None), "__file__", None)
        if not isinstance(path, str) or not os.path.isfile(path):
            raise UnsupportedGraphError(
                f"inductor built a C++ kernel this torch does not expose as a file ({path!r})"
            )
        with open(path, "rb") as handle:
            data = handle.read()
        kernel = NativeKernel(
            key=kernel_key(argtypes, source),
            binary=sha256_hex(data),
            isa=isa,
            cpu_features=cpu_features_for_flags(flags),
            machine=platform.machine(),
        )
        built.append((kernel, data))
    return tuple(built)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a FakeTensor (shape only, cannot run a kernel)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


# -- expressions and the caller's ShapeEnv -------------------------------------------
def print_expr(expr: sympy.Expr) -> str:
    """Python syntax for an integer/boolean sympy expression (what artifacts store)."""
    from torch.utils._sympy.printers import PythonPrinter

    return str(PythonPrinter().doprint(expr))


def evaluate(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> bool:
    return bool(sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in values.items()}))


def add_caller_guard(shape_env: Any, expr: sympy.Expr) -> None:
    """Record ``expr`` (true at the caller's hints) as a guard of the caller's ShapeEnv."""
    shape_env.evaluate_expr(expr)


# -- what the cache key needs from torch ---------------------------------------------
_CONFIG_MODULES = ("torch._inductor.config", "torch._functorch.config")
_ENV_NAME = re.compile(r"""["']([A-Z][A-Z0-9_]{2,127})["']""")


def codegen_config_digest() -> str:
    """sha256 of what the inductor and functorch configs hold besides their defaults (by
    value, as ``save_config_portable`` exports them), the environment variables their
    modules read, and the attention backends variants are compiled with.

    A config module not imported holds its defaults, and the environment sets those
    defaults only through the variables it reads: where none of them is set, the digest
    is computed without importing inductor, whose package imports Dynamo (5-10 s on a
    GPU host). A serving process that never imported the compiler so looks its model up
    without importing it, under the key a build process with the same configs computed."""
    environment = _config_environment()
    changed: dict[str, Any] = {}
    for name in _CONFIG_MODULES:
        config = sys.modules.get(name)
        if config is None and environment:
            log.info("the cache key imports %s: the environment sets %s", name, sorted(environment))
            config = importlib.import_module(name)
        if config is not None:
            differing = _non_defaults(config)
            if differing:
                changed[name] = differing
    snapshot = {
        "changed": changed,
        "environment": environment,
        # the attention kernels variants are compiled with
        "sdpa": attention_key_factor(sdpa_switches()),
    }
    text = json.dumps(snapshot, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def inductor_config_changes() -> frozenset[str]:
    """The inductor config entries this process holds at other than their defaults (none
    where inductor's config is not imported and no variable of its is set)."""
    config = sys.modules.get("torch._inductor.config")
    if config is None and _config_environment():
        config = importlib.import_module("torch._inductor.config")
    return frozenset(_non_defaults(config)) if config is not None else frozenset()


def _non_defaults(config: Any) -> dict[str, Any]:
    """The config's portable entries whose value is not their default (all of them where
    this torch's config module does not say what a default is)."""
    portable: dict[str, Any] = config.save_config_portable()
    entries = getattr(config, "_config", None)
    if not isinstance(entries, dict):
        return portable
    differing = {}
    for key, value in portable.items():
        entry = entries.get(key)
        default = getattr(entry, "default", _MISSING)
        if default is _MISSING or value != default:
            differing[key] = value
    return differing


_MISSING = object()


# Names the config modules read only to name this process's logs (a launcher such as
# torchrun sets ROLE_RANK per rank): they change no compiled code, and in the key they
# would give each rank its own entry.
_LOG_ONLY_NAMES = frozenset(
    {
        "ROLE_RANK",
        "MAST_HPC_JOB_NAME",
        "LOG_TLPARSE",
        "TORCHINDUCTOR_WORKER_LOGPATH",
        "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING",
        "INDUCTOR_LOG_URL_FOR_GRAPH_XFORM",
        "TORCHINDUCTOR_AUTOHEURISTIC_LOG_PATH",
        "TORCHINDUCTOR_TRITON_PROTON_OUTPUT_DIR",
    }
)


@functools.lru_cache(maxsize=1)
def _config_environment_names() -> frozenset[str]:
    """Every environment variable name the config modules' source spells as a string,
    but those read only to name logs."""
    names: set[str] = set()
    root = os.path.dirname(torch.__file__)
    for relative in ("_inductor/config.py", "_functorch/config.py"):
        try:
            with open(os.path.join(root, relative), encoding="utf-8") as file:
                names.update(_ENV_NAME.findall(file.read()))
        except OSError:
            names.add(f"<{relative} unreadable>")
    return frozenset(names - _LOG_ONLY_NAMES)


def _config_environment() -> dict[str, str]:
    """The environment variables that can set the configs' defaults, as set now."""
    names = _config_environment_names()
    return {key: value for key, value in sorted(os.environ.items()) if key in names}


# -- collectives ------------------------------------------------------------------------
# torch's collectives whose ``group_name`` argument is a name torch registered a process
# group under (resolved again by the op at every call)
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
_TORCH_COLLECTIVE_NAMESPACES = (*_FUNCTIONAL_NAMESPACES, "symm_mem", "_dtensor")


def _op_schema(target: Any) -> Any | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket):
        overload = getattr(target, "default", None)
        return None if overload is None else overload._schema
    return None


@dataclass(frozen=True)
class GraphCollectives:
    """What a graph's collectives run over. ``groups``: the names of the torch process
    groups torch's own collectives name. ``opaque``: other ops taking a ``group_name`` (a
    framework's own collectives: vLLM's ``vllm::all_reduce(x, group_name="tp:0")`` names
    its own registry, not torch's), whose group this library cannot see."""

    groups: tuple[str, ...]
    opaque: tuple[str, ...]


def graph_collectives(gm: torch.fx.GraphModule) -> GraphCollectives:
    """The graph's collectives, in first-use order."""
    groups: dict[str, None] = {}
    opaque: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        schema = _op_schema(node.target)
        if schema is None:
            continue
        namespace = schema.name.split("::", 1)[0]
        names = [a.name for a in schema.arguments]
        if "group_name" not in names:
            if namespace == "c10d_functional":
                raise UnsupportedGraphError(
                    f"the graph calls {schema.name}, a legacy collective that names its group "
                    "by tag and ranks; use torch.distributed._functional_collectives"
                )
            continue
        if namespace not in _TORCH_COLLECTIVE_NAMESPACES:
            opaque.setdefault(schema.name)
            continue
        position = names.index("group_name")
        value = node.args[position] if position < len(node.args) else node.kwargs.get("group_name")
        if not isinstance(value, str):
            raise UnsupportedGraphError(
                f"the graph calls {schema.name} with group {value!r}; precompile needs the "
                "group named by a string (what torch.distributed._functional_collectives "
                "traces to)"
            )
        groups.setdefault(value)
    return GraphCollectives(tuple(groups), tuple(opaque))


def _writes_nothing(func: Any, args: Any, kwargs: Any) -> Any:
    """What a collective returns, run here alone: outputs of the shapes, strides and
    dtypes its fake implementation gives, filled with zeros; nothing is written."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = func(*args, **kwargs)

    def real(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        empty = torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=value.device
        )
        return empty.zero_()

    return real(fake) if len(func._schema.returns) == 1 else tuple(real(v) for v in fake)


class _LocalCollectives(TorchDispatchMode):  # type: ignore[misc]
    """Collectives as local no-ops of the same shapes, for one run whose values nobody
    reads (compile_model's trace: it learns the output structure and what the call
    writes). A real collective there would wait for ranks that are not tracing."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        takes_group = any(a.name == "group_name" for a in func._schema.arguments)
        if func.namespace not in _TORCH_COLLECTIVE_NAMESPACES and not takes_group:
            return func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[1]
        if func.namespace in _FUNCTIONAL_NAMESPACES:  # local copies known per op
            if name in ("wait_tensor", "all_reduce_", "all_reduce_coalesced_", "broadcast_"):
                return args[0]
            if name in ("all_reduce", "broadcast"):
                return args[0].clone()
            if name == "all_reduce_coalesced":
                return [t.clone() for t in args[0]]
            if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
                gathered = torch.cat([args[0]] * int(args[1]))
                out = kwargs.get("out")
                return gathered if out is None else out.copy_(gathered)
            if name == "reduce_scatter_tensor":
                return args[0].narrow(0, 0, args[0].shape[0] // int(args[2])).clone()
        if not takes_group:
            raise UnsupportedGraphError(
                f"compile_model cannot trace a graph that calls {func}: its one traced run "
                "replaces collectives by local copies, and knows none for this one"
            )
        try:
            return _writes_nothing(func, args, kwargs)
        except Exception as exc:  # no fake implementation, or one that fails
            raise UnsupportedGraphError(
                f"compile_model cannot trace a graph that calls {func}: its one traced run "
                "makes collectives local (a real one would wait for ranks that are not "
                f"tracing), from the op's fake implementation, which failed: {exc}"
            ) from exc


# -- tracing a whole model (compile_model) --------------------------------------------
@dataclass
class ModelTrace:
    """One Dynamo trace of ``model(*args, **kwargs)`` with its one graph compiled."""

    call: tuple[tuple[Any, ...], dict[str, Any]]
    result: Any  # what the traced call returned
    example_inputs: list[Any]  # what Dynamo handed the backend (real tensors, SymInts)
    placeholder_names: list[str]
    graph_outputs: list[Any]  # the flat outputs the compiled graph returned
    traced_files: set[str]  # source files of every code object Dynamo traced
    artifact: Any
    # Dynamo's guards of the trace, as plain records (see ``guard_records``)
    guards: list[GuardEntry] = field(default_factory=list)
    traced_code: Any = None  # the code object of the frame Dynamo compiled


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


def _guard_entry(entry: Any) -> GuardEntry:
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


def trace_model(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compile_graph: Any,
    before_run: Callable[[Any, Any, Sequence[Any]], None] | None = None,
) -> ModelTrace:
    """Trace the call once with Dynamo (``fullgraph``: a graph break is an
    ``UnsupportedGraphError`` quoting Dynamo's explanation), compile its graph with
    ``compile_graph(gm, example_inputs)`` inside the backend, and run it once (with its
    collectives, if any, made local: ranks trace at different times, or not at all).
    ``before_run(gm, artifact, flat_inputs)`` is called just before that run: the
    compiled artifact's manifest says which of those inputs the graph writes."""
    from torch._guards import TracingContext

    seen: list[dict[str, Any]] = []
    guards: list[GuardEntry] = []

    def keep_every_guard(entries: Sequence[Any]) -> list[bool]:
        guards.extend(_guard_entry(e) for e in entries)
        return [True] * len(entries)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        context = TracingContext.try_get()
        codes = list(getattr(context, "traced_code", None) or [])
        record: dict[str, Any] = {
            "code": codes[0] if codes else None,
            "inputs": list(example_inputs),
            "names": [n.name for n in gm.graph.nodes if n.op == "placeholder"],
            "files": {c.co_filename for c in codes if os.path.isfile(c.co_filename)},
            "artifact": compile_graph(gm, list(example_inputs)),
            "outputs": None,
        }
        seen.append(record)

        collectives = bool(record["artifact"].manifest.process_groups)

        def run(*flat: Any) -> Any:
            if before_run is not None:
                before_run(gm, record["artifact"], flat)
            with _LocalCollectives() if collectives else contextlib.nullcontext():
                outputs = record["artifact"](*flat)
            record["outputs"] = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            return outputs

        return run

    torch.compiler.reset()
    try:
        compiled = torch.compile(
            model, backend=backend, fullgraph=True, options={"guard_filter_fn": keep_every_guard}
        )
        result = compiled(*args, **kwargs)
    except torch._dynamo.exc.Unsupported as exc:
        raise UnsupportedGraphError(
            f"the model does not trace as one graph (a graph break): {str(exc).strip()[:2000]}"
        ) from None
    finally:
        torch.compiler.reset()
    if len(seen) != 1:
        raise UnsupportedGraphError(f"tracing the model gave {len(seen)} graphs; it needs one")
    record = seen[0]
    if record["outputs"] is None:
        raise UnsupportedGraphError("the traced graph never ran; its outputs are unknown")
    return ModelTrace(
        call=(args, kwargs),
        result=result,
        example_inputs=record["inputs"],
        placeholder_names=record["names"],
        graph_outputs=record["outputs"],
        traced_files=record["files"],
        artifact=record["artifact"],
        guards=guards,
        traced_code=record["code"],
    )


_GRAPH_NAME = "precompile_graph_name"  # in a GraphModule's ``meta``


def name_graph(gm: torch.fx.GraphModule, name: str | None = None) -> None:
    """Keep ``name`` (else ``graph_name(gm)``) on the graph (called inside a backend, by
    ``capture_graph``)."""
    gm.meta[_GRAPH_NAME] = name or graph_name(gm)


def graph_name(gm: torch.fx.GraphModule) -> str:
    """What a person calls the graph: inside a torch.compile backend (or as kept by
    ``name_graph``), the function Dynamo traced it from (``Model.forward (file.py:30)``);
    else its GraphModule's class (``fx.symbolic_trace`` names it after the module's)."""
    from torch._guards import TracingContext

    kept = gm.meta.get(_GRAPH_NAME)
    if isinstance(kept, str):
        return kept
    context = TracingContext.try_get()
    codes = list(getattr(context, "traced_code", None) or [])
    if not codes:
        return type(gm).__name__
    # The frame Dynamo compiles comes first, the functions it inlined follow. Torch's own
    # wrappers (``capture_graph`` traces through ``wrap_inline``) say nothing of the
    # model: the first code outside torch names it, else torch's first ``forward`` (an
    # ``nn.Sequential``'s), else the first code outside Dynamo.
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    dynamo_dir = os.path.join(torch_dir, "_dynamo") + os.sep
    code = min(codes, key=lambda c: (c.co_filename.startswith(torch_dir),
                                     c.co_filename.startswith(dynamo_dir),
                                     c.co_name != "forward"))  # fmt: skip
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


# -- the lean path: proving a variant's wrapping trivial ------------------------------
# torch.ops namespaces of torch's own operators: a call into any other namespace is a
# user's custom op, which AOTAutograd checks for aliasing on a graph's first call.
_BUILTIN_OP_NAMESPACES = frozenset(
    {"aten", "prim", "prims", "inductor", "quantized", "_quantized", "mkldnn", "onednn"}
)
_TRIVIAL_DISPATCH_WRAPPERS = frozenset(
    {"AOTDedupeWrapper", "AOTSyntheticBaseWrapper", "EffectTokensWrapper"}
)


def _dotted(node: Any) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None."""
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _executed_nodes(tree: Any) -> Iterator[Any]:
    """Every AST node of a wrapper module that loading or calling it can run: all but
    inductor's benchmark helpers and the ``if __name__ == "__main__"`` block."""
    import ast

    for statement in tree.body:
        if isinstance(statement, ast.FunctionDef) and statement.name in runtime_adapter._UNCALLED:
            continue
        if (
            isinstance(statement, ast.If)
            and isinstance(statement.test, ast.Compare)
            and _dotted(statement.test.left) == "__name__"
        ):
            continue
        yield from ast.walk(statement)


# What inductor's GPU wrapper modules import besides the CPU ones: the bandwidth
# profiler's markers (never called on the lean path: checked below) and Triton itself,
# named only inside kernel source strings, which the lean path never compiles.
_GPU_LEAN_IMPORTS = {
    "torch._inductor.runtime.triton_heuristics": frozenset({"start_graph", "end_graph"})
}
_GPU_LEAN_MODULES = frozenset({"triton", "triton.language"})
_UNCALLED_ON_GPU = frozenset({"start_graph", "end_graph", "triton", "tl"})


@dataclass(frozen=True)
class SourceScan:
    """What a generated wrapper module needs of the lean path: why it cannot run there
    (empty if it can), the ``extern_kernels`` it uses, the Triton kernels it creates."""

    blockers: tuple[str, ...]
    externs: tuple[str, ...]
    triton_kernels: tuple[str, ...]


def lean_source_blockers(source: str, *, gpu: bool = False) -> tuple[list[str], list[str]]:
    """Why a generated wrapper module cannot run on the lean path's stand-ins (empty if it
    can), and the ``extern_kernels`` names it uses."""
    scan = scan_lean_source(source, gpu=gpu)
    return list(scan.blockers), list(scan.externs)


def scan_lean_source(source: str, *, gpu: bool = False) -> SourceScan:
    """Read a generated wrapper module for the lean path (``gpu``: a CUDA variant whose
    Triton kernels are launched from their binaries)."""
    import ast

    blockers: list[str] = []
    externs: set[str] = set()
    kernels: list[str] = []
    tree = ast.parse(source)
    defined = set()
    allowed_imports = {**runtime_adapter.LEAN_IMPORTS, **(_GPU_LEAN_IMPORTS if gpu else {})}
    for node in _executed_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                blockers.append(f"a relative import of {module}")
            elif module.startswith(runtime_adapter._COMPILER_PACKAGES):
                allowed = allowed_imports.get(module, frozenset())
                names = {alias.name for alias in node.names}
                if not names <= allowed:
                    blockers.append(f"imports {sorted(names - allowed)} from {module}")
            elif module == "triton" or module.startswith("triton."):
                blockers.append(f"imports from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(runtime_adapter._COMPILER_PACKAGES) or (
                    alias.name.partition(".")[0] == "triton"
                    and not (gpu and alias.name in _GPU_LEAN_MODULES)
                ):
                    blockers.append(f"imports {alias.name}")
        elif (
            gpu
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "async_compile"
            and node.func.attr == "triton"
        ):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                kernels.append(first.value)
            else:
                blockers.append("creates a Triton kernel with no literal name")
        elif (
            gpu
            and isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Load)
            and node.id in _UNCALLED_ON_GPU
        ):
            blockers.append(f"uses {node.id} outside its imports")
        elif isinstance(node, ast.Attribute):
            path = _dotted(node) or ""
            if path.startswith(runtime_adapter._COMPILER_PACKAGES):
                blockers.append(f"uses {path}")
            elif path.startswith("torch.ops.") and path.count(".") >= 2:
                namespace = path.split(".")[2]
                if namespace not in _BUILTIN_OP_NAMESPACES:
                    blockers.append(f"calls custom operators (torch.ops.{namespace})")
            elif isinstance(node.value, ast.Name) and node.value.id == "extern_kernels":
                externs.add(node.attr)
            elif (
                isinstance(node.value, ast.Name)
                and node.value.id == "async_compile"
                and node.attr not in ("cpp_pybinding", "wait", *(("triton",) if gpu else ()))
            ):
                blockers.append(f"compiles kernels with async_compile.{node.attr}")
        if isinstance(node, ast.Name) and node.id in ("extern_kernels", "async_compile"):
            defined.add(node.id)
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    defined.add(target.id)
    if "call" not in defined:
        blockers.append("defines no module-level call")
    if len(set(kernels)) != len(kernels):
        blockers.append("creates a Triton kernel name twice")
    return SourceScan(tuple(dict.fromkeys(blockers)), tuple(sorted(externs)), tuple(kernels))


def _extern_path(name: str) -> str | None:
    """Where ``extern_kernels.<name>`` of this process lives under torch, outside its
    compiler (``torch.addmm``, ``torch.ops.aten.mm.out``), or None."""
    from torch._inductor.select_algorithm import extern_kernels

    value = getattr(extern_kernels, name, None)
    if value is None:
        return None
    candidates = [f"torch.{name}"]
    if isinstance(value, torch._ops.OpOverloadPacket):
        namespace, _, op = value._qualified_op_name.partition("::")
        candidates.append(f"torch.ops.{namespace}.{op}")
    elif isinstance(value, torch._ops.OpOverload):
        namespace, _, op = value._overloadpacket._qualified_op_name.partition("::")
        candidates.append(f"torch.ops.{namespace}.{op}.{value._overloadname}")
    for path in candidates:
        parts = path.split(".")
        if parts[1] == "ops" and parts[2] not in _BUILTIN_OP_NAMESPACES:
            continue
        if not runtime_adapter.extern_path_names(name, path):
            continue  # a load refuses a path naming another operator than the name
        try:
            if runtime_adapter.resolve_torch_path(path) is value:
                return path
        except (AttributeError, ValueError, RuntimeError):
            continue
    return None


def _lean_support_matches() -> list[str]:
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


@dataclass(frozen=True)
class LeanPlan:
    """A variant's lean call (None where its wrapping is not provably trivial: then
    ``reasons`` say why) and the source it runs. ``triton_kernels``: the Triton kernels
    the source creates, whose launches must still be recorded (``lean.triton``) by running
    the variant before the lean call is complete."""

    lean: LeanCall | None
    source: str
    reasons: tuple[str, ...]
    triton_kernels: tuple[str, ...] = ()


def lean_plan(payload: bytes, source_digest: Callable[[str], str]) -> LeanPlan:
    """Decide whether a variant runs on the lean path: what AOTAutograd and inductor wrap
    around its generated ``call`` at load must be nothing, or only what ``LeanCall``
    replays (grad mode off during the call, outputs as a list of the expected length,
    version bumps of inputs the graph writes in place, Dynamo's dynamic-dim marks on
    outputs, autocast off where it was on at load). Read against torch 2.10 to 2.13's
    ``runtime_wrappers``, ``aot_autograd_result`` and ``output_code``: any wrapper or
    field not known to be a no-op here keeps the variant on upstream's path."""
    entry, _, _ = runtime_adapter.unpickle_bundle(payload)
    graph = runtime_adapter.forward_graph(entry)
    source = str(graph.source_code)
    reasons: list[str] = []

    def require(condition: Any, reason: str) -> None:
        if not condition:
            reasons.append(reason)

    metadata = entry.runtime_metadata
    require(type(entry).__name__ == "BundledAOTAutogradResult", "not a bundled AOTAutograd entry")
    require(getattr(entry, "compiled_bw", None) is None, "it has a backward graph")
    require(getattr(entry, "maybe_subclass_meta", None) is None, "it has tensor subclasses")
    require(not getattr(metadata, "act_input_indices", None), "it has activation inputs")
    require(not metadata.is_rng_op_functionalized, "it functionalizes RNG state")
    require(not getattr(metadata, "num_outputs_rng_offset", 0), "it returns an RNG offset")
    require(len(metadata.tokens) == 0, "it threads effect tokens")
    require(not metadata.mutated_inp_runtime_indices, "it writes inputs outside the graph")
    require(metadata.num_outputs_aliased == 0, "an output aliases an input or intermediate")
    require(metadata.num_intermediate_bases == 0, "it returns intermediate bases")
    require(metadata.grad_enabled_mutation is None, "it changes grad mode")
    require(
        getattr(metadata, "mutated_inp_stream_indices", None) in (None, [])
        or all(i is None for i in metadata.mutated_inp_stream_indices),
        "it writes inputs on user streams",
    )
    for wrapper in getattr(entry, "dispatch_wrappers", None) or []:
        name = type(wrapper).__name__
        require(
            name in _TRIVIAL_DISPATCH_WRAPPERS
            and not getattr(wrapper, "needs_post_compile", False),
            f"its {name} wraps calls",
        )
    require(type(graph).__name__ == "CompiledFxGraph", "its output is not a CompiledFxGraph")
    devices = set(getattr(graph, "device_types", ()))
    gpu = "cuda" in devices
    require(devices <= {"cpu", "cuda"}, f"it runs on {sorted(devices - {'cpu', 'cuda'})}")
    require(
        not gpu or getattr(torch.version, "hip", None) is None,
        "it runs on ROCm (whose kernels take other launch arguments)",
    )
    require(
        not gpu or runtime_adapter.static_launcher() is not None,
        "this torch has no static CUDA launcher",
    )
    require(not getattr(graph, "constants", None), "it carries constants")
    require(not getattr(graph, "torchbind_constants", None), "it carries torchbind constants")
    require(not getattr(graph, "_wrap_compiled_regions", False), "its regions are wrapped")
    bundle = getattr(graph, "_triton_bundle", None)
    require(
        gpu
        or bundle is None
        or not (getattr(bundle, "kernel_artifacts", 1) or getattr(bundle, "static_autotuners", 1)),
        "it bundles Triton kernels",
    )
    check = list(getattr(graph, "inputs_to_check", ()) or ())
    mutated = set(getattr(graph, "mutated_input_idxs", ()) or ())
    if getattr(graph, "_defers_input_alignment", False):
        check = [i for i in check if i in mutated]
    require(gpu or not check, "inductor realigns its inputs")
    scan = scan_lean_source(source, gpu=gpu)
    names = scan.externs
    reasons.extend(f"its code {b}" for b in scan.blockers)
    externs = {}
    for name in names:
        path = _extern_path(name)
        require(path is not None, f"extern kernel {name} is not a torch operator")
        if path is not None:
            externs[name] = path
    reasons.extend(_lean_support_matches())
    if reasons:
        return LeanPlan(None, source, tuple(dict.fromkeys(reasons)))
    bumps: tuple[int, ...] = ()
    if entry.sanitized_aot_config.keep_inference_input_mutations:
        bumps = tuple(int(i) for i in metadata.mutated_graph_handled_indices_seen_by_autograd)
    dims: tuple[tuple[int, tuple[int, ...]], ...] = ()
    if metadata.dynamic_outputs:
        dims = tuple(
            (index, tuple(sorted(int(d) for d in info.dynamic_dims)))
            for index, info in enumerate(metadata.output_info)
            if info.dynamic_dims is not None
        )
    attribute = _dynamic_dims_attribute() if dims else None
    if dims and attribute is None:
        return LeanPlan(None, source, ("this torch marks outputs' dynamic dims unrecognizably",))
    lean = LeanCall(
        source=source_digest(source),
        externs=externs,
        outputs=int(metadata.num_outputs),
        bump_versions=bumps,
        dynamic_dims=dims,
        dynamic_attribute=attribute,
        align=tuple(int(i) for i in check),
        realign=tuple(int(i) for i in check if i in mutated),
    )
    return LeanPlan(lean, source, (), scan.triton_kernels)


# -- the lean path on GPUs: what inductor launched, recorded -------------------------
def load_generated_module(source: str) -> Any:
    """Import a generated wrapper module as inductor does (its Triton kernels loaded
    through ``async_compile``, from Triton's cache where this process compiled them)."""
    from torch._inductor.codecache import PyCodeCache

    with runtime_adapter._no_compile_workers():
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
    path = os.path.join(triton_cache_dir(device), launcher.cache_hash, f"{kernel.name}.cubin")
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
def _dynamic_dims_attribute() -> str | None:
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
