"""``describe_graph``: the caller's graph read once into a ``GraphDescription`` (``_graph``),
the plain data the rest of the compile side uses. Nothing here mutates the caller's
graph or ShapeEnv."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from precompile.runtime import InvalidOptionError, UnsupportedGraphError

from . import _torch_adapter as adapter
from ._graph import GraphDescription, GraphInput

log = logging.getLogger("precompile.compile")

DYNAMIC_SHAPES = ("from_graph", "from_tracing_context", "from_example_inputs")


def _resolve_fake_mode(gm: torch.fx.GraphModule, dynamic_shapes: str) -> Any | None:
    if dynamic_shapes == "from_example_inputs":
        return None
    if dynamic_shapes == "from_tracing_context":
        fake_mode = adapter.tracing_fake_mode()
        if fake_mode is None:
            raise InvalidOptionError(
                "dynamic_shapes='from_tracing_context' needs an active tracing context "
                "(call it from inside a torch.compile backend)"
            )
        return fake_mode
    for node in reversed(gm.graph.nodes):
        if node.op != "output":
            continue
        outputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        for out in outputs:
            value = getattr(out, "meta", {}).get("example_value", None)
            if value is None:
                value = getattr(out, "meta", {}).get("val", None)
            if adapter.is_fake(value):
                return adapter.fake_mode_of(value)
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
        expr = adapter.symint_expr(value)
        if shape_env is not None and adapter.shape_env_of(value) is shape_env:
            expr = adapter.apply_replacements(shape_env, expr)
        return sympy.sympify(expr)
    return sympy.Integer(int(value))


def symbol_hint(shape_env: Any, symbol: sympy.Symbol) -> int:
    """The size ``symbol`` was traced at; an unbacked symbol is refused."""
    hint = adapter.size_hint(shape_env, symbol)
    if hint is None:
        raise UnsupportedGraphError(
            f"symbol {symbol} has no hint (unbacked symbols are not supported as inputs)"
        )
    return hint


def _range(shape_env: Any, symbol: sympy.Symbol) -> tuple[int, int | None]:
    low, high = adapter.symbol_range(shape_env, symbol)
    # Dynamo's lower bound of 2 only reflects its 0/1 specialization; variants are compiled
    # without that assumption (their own guards say what they need), so sizes 0/1 stay open.
    if low is None or low == 2:
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
    shape_env = adapter.mode_shape_env(fake_mode)
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
                env = shape_env or adapter.shape_env_of(value)
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
                size = _expr(value, shape_env or adapter.shape_env_of(value))
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
    hints = {s: symbol_hint(shape_env, s) for s in symbols}
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
    for guard in adapter.recorded_guards(shape_env):
        expr = sympy.sympify(adapter.apply_replacements(shape_env, guard))
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
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if output is None:
        return None
    shapes: list[tuple[sympy.Expr, ...] | None] = []
    for node in adapter.tree_leaves(output.args[0]):
        value = getattr(node, "meta", {}).get("example_value", getattr(node, "meta", {}).get("val"))
        if isinstance(value, torch.Tensor):
            shape = tuple(_expr(s, shape_env or adapter.shape_env_of(s)) for s in value.shape)
            shapes.append(shape)
        else:
            shapes.append(None)
    return tuple(shapes)


def _input_name(placeholders: Sequence[Any], index: int) -> str | None:
    """What input ``index`` is in the caller's code: Dynamo's source of it (``L['x']``,
    ``L['self']._modules['fc']._parameters['weight']``), else the placeholder's name."""
    if index >= len(placeholders):
        return None
    node = placeholders[index]
    text = adapter.placeholder_source_name(node) or str(node.target)
    return text[:200]


def _static_address(placeholders: Sequence[Any], index: int, examples: Sequence[Any]) -> bool:
    """Whether Dynamo marked input ``index`` static (parameters and buffers of modules)."""
    example = examples[index] if index < len(examples) else None
    if adapter.has_static_mark(example):
        return True
    if isinstance(example, torch.nn.Parameter):
        return True
    if index < len(placeholders):
        return adapter.placeholder_marked_static(placeholders[index])
    return False


def _float_scalar(value: Any, example: Any) -> tuple[float | None, Any]:
    """The float a 0-d tensor input stands for, if Dynamo made it of a Python float
    (its fake carries the SymFloat ``item()`` returns), and that SymFloat."""
    if not (adapter.is_fake(value) and value.dim() == 0 and value.dtype.is_floating_point):
        return None, None
    memo = adapter.item_memo(value)
    if not isinstance(memo, torch.SymFloat):
        return None, None
    if isinstance(example, torch.Tensor) and not adapter.is_fake(example):
        return float(example.item()), memo
    hint = adapter.symfloat_hint(memo)
    if hint is None:
        raise UnsupportedGraphError("a float input has no value to specialize the variants to")
    return float(hint), memo


def _output_spec(gm: torch.fx.GraphModule) -> str | None:
    """Upstream's pytree spec of the graph's output where compile_fx flattens it (a single
    value, as ``split_module`` submodules return, or a dict): the artifact rebuilds it."""
    if adapter.graph_returns_tuple(gm):
        return None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return adapter.treespec_json(output.args[0])


def _first_env(values: Sequence[Any]) -> Any:
    for value in values:
        env = adapter.shape_env_of(value)
        if env is None and isinstance(value, torch.Tensor):
            for size in value.shape:
                env = adapter.shape_env_of(size)
                if env is not None:
                    break
        if env is not None:
            return env
    raise UnsupportedGraphError("graph has symbolic sizes but no ShapeEnv could be found")


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
