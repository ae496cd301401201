"""Safe compilation of the integer expressions an artifact carries (guards, dim sizes).

Artifacts store guards as Python-syntax strings so that loading needs no sympy. The
strings come from a file, so they are parsed and checked against a small allowlist of
syntax before anything is compiled: only symbol names, numbers, arithmetic, comparisons,
boolean logic and a few pure functions.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import CorruptArtifactError

SYMBOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_FUNCTIONS: dict[str, Any] = {"max": max, "min": min, "abs": abs, "int": int, "float": float}
_MATH_FUNCTIONS = frozenset({"floor", "ceil", "trunc", "sqrt", "log2"})
_MAX_EXPONENT = 64
_ALLOWED_NODES: tuple[type[ast.AST], ...] = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.Div,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Attribute,
    ast.Constant,
    ast.IfExp,
)


def _check_node(node: ast.AST, symbols: frozenset[str], text: str) -> None:
    if not isinstance(node, _ALLOWED_NODES):
        raise CorruptArtifactError(
            f"expression {text!r} uses {type(node).__name__}, which artifacts may not contain"
        )
    if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool)):
        raise CorruptArtifactError(f"expression {text!r} has a non-numeric constant")
    if isinstance(node, ast.Name) and node.id not in (*symbols, *_FUNCTIONS, "math"):
        raise CorruptArtifactError(
            f"expression {text!r} names {node.id!r}, which is not a symbol of this artifact"
        )
    if isinstance(node, ast.Attribute) and not (
        isinstance(node.value, ast.Name)
        and node.value.id == "math"
        and node.attr in _MATH_FUNCTIONS
    ):
        raise CorruptArtifactError(f"expression {text!r} has a forbidden attribute access")
    if isinstance(node, ast.Call):
        func = node.func
        allowed = (isinstance(func, ast.Name) and func.id in _FUNCTIONS) or isinstance(
            func, ast.Attribute
        )
        if not allowed or node.keywords:
            raise CorruptArtifactError(f"expression {text!r} calls something not allowed")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        exponent = node.right
        if not (
            isinstance(exponent, ast.Constant)
            and isinstance(exponent.value, int)
            and 0 <= exponent.value <= _MAX_EXPONENT
        ):
            raise CorruptArtifactError(f"expression {text!r} has an unbounded power")
    for child in ast.iter_child_nodes(node):
        _check_node(child, symbols, text)


def check_expression(text: str, symbols: Sequence[str]) -> ast.Expression:
    """Parse ``text`` and verify it only uses allowed syntax over ``symbols``."""
    if not isinstance(text, str) or len(text) > 10_000:
        raise CorruptArtifactError(f"expression {text!r} is not a string of sane length")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CorruptArtifactError(f"expression {text!r} does not parse: {exc.msg}") from None
    _check_node(tree, frozenset(symbols), text)
    return tree


def compile_function(
    texts: Sequence[str], symbols: Sequence[str], *, name: str = "expressions"
) -> Callable[..., tuple[Any, ...]]:
    """One function ``f(*symbol_values) -> tuple`` evaluating every text, in order."""
    for symbol in symbols:
        if not SYMBOL_NAME.match(symbol):
            raise CorruptArtifactError(f"symbol name {symbol!r} is not an identifier")
    for text in texts:
        check_expression(text, symbols)
    params = ", ".join(symbols)
    body = ", ".join(f"({text})" for text in texts)
    source = f"def {name}({params}):\n    return ({body}{',' if len(texts) == 1 else ''})\n"
    namespace: dict[str, Any] = {"__builtins__": {}, "math": math, **_FUNCTIONS}
    exec(compile(source, f"<precompile {name}>", "exec"), namespace)
    function: Callable[..., tuple[Any, ...]] = namespace[name]
    return function
