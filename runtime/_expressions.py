"""Safe compilation of the integer expressions an artifact carries (guards, sizes, strides).

Artifacts store expressions as Python-syntax strings so that loading needs no sympy. The
strings come from a file, so each is parsed and checked against a small allowlist of
syntax (symbol names, numbers, arithmetic, comparisons, boolean logic, a few pure
functions), with bounds on length, nesting and magnitude. What runs is compiled from the
checked tree itself, never from joined text, and every symbol is renamed into a private
namespace (``v_<name>``), so no symbol name can shadow a name the generated code uses.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._errors import CorruptArtifactError

SYMBOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
SYMBOL_PREFIX = "v_"  # how generated code spells a symbol: v_s0

_FUNCTIONS: dict[str, Any] = {"max": max, "min": min, "abs": abs, "int": int, "float": float}
_MATH_FUNCTIONS = frozenset({"floor", "ceil", "trunc", "sqrt", "log2"})
_MAX_EXPONENT = 64
_MAX_LENGTH = 10_000
_MAX_DEPTH = 48
_MAX_CONSTANT = 2**64
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


def check_symbol_name(name: object) -> str:
    """``name`` if it can name a symbol (an ASCII identifier, not a keyword)."""
    if not isinstance(name, str) or not SYMBOL_NAME.match(name) or keyword.iskeyword(name):
        raise CorruptArtifactError(
            f"symbol name {name!r:.80} is not an ASCII identifier of at most 64 characters"
        )
    if name in _FUNCTIONS or name == "math":
        raise CorruptArtifactError(f"symbol name {name!r} is the name of a function")
    return name


def _check_node(node: ast.AST, symbols: frozenset[str], text: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise CorruptArtifactError(f"expression {text[:80]!r}... nests deeper than {_MAX_DEPTH}")
    if not isinstance(node, _ALLOWED_NODES):
        raise CorruptArtifactError(
            f"expression {text!r} uses {type(node).__name__}, which artifacts may not contain"
        )
    if isinstance(node, ast.Constant):
        value = node.value
        if not isinstance(value, (int, float, bool)):
            raise CorruptArtifactError(f"expression {text!r} has a non-numeric constant")
        if isinstance(value, float) and not math.isfinite(value):
            raise CorruptArtifactError(f"expression {text!r} has a non-finite constant")
        if abs(value) > _MAX_CONSTANT:
            raise CorruptArtifactError(f"expression {text!r} has a constant above 2**64")
    if isinstance(node, ast.Name) and not (
        node.id in symbols or node.id in _FUNCTIONS or node.id == "math"
    ):
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
            and type(exponent.value) is int
            and 0 <= exponent.value <= _MAX_EXPONENT
        ):
            raise CorruptArtifactError(f"expression {text!r} has an unbounded power")
        if any(
            isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Pow)
            for inner in ast.walk(node.left)
        ):
            raise CorruptArtifactError(f"expression {text!r} raises a power to a power")
    for child in ast.iter_child_nodes(node):
        _check_node(child, symbols, text, depth + 1)


def parse_expression(text: object, symbols: Sequence[str]) -> ast.expr:
    """Parse ``text`` and verify it only uses allowed syntax over ``symbols``."""
    if not isinstance(text, str) or not 0 < len(text) <= _MAX_LENGTH:
        raise CorruptArtifactError(f"expression {text!r:.80} is not a string of sane length")
    if not text.isascii() or not text.isprintable() or "#" in text:
        raise CorruptArtifactError(
            f"expression {text!r:.80} has characters no expression needs (non-ASCII, "
            "control characters or '#')"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CorruptArtifactError(f"expression {text!r:.80} does not parse: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CorruptArtifactError(f"expression {text[:80]!r}... is too deeply nested") from None
    _check_node(tree, frozenset(symbols), text, 0)
    return tree.body


def check_expression(text: object, symbols: Sequence[str]) -> str:
    """``text`` if it is an allowed expression over ``symbols`` (else CorruptArtifactError)."""
    parse_expression(text, symbols)
    return str(text)


class _Rename(ast.NodeTransformer):
    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.Name:
        target = self.mapping.get(node.id)
        return node if target is None else ast.copy_location(ast.Name(target, node.ctx), node)


def to_python(text: str, symbols: Sequence[str], rename: Mapping[str, str] | None = None) -> str:
    """Canonical Python source of a checked expression, symbols renamed as ``rename`` says
    (default: ``v_<name>``). The text is regenerated from the checked tree, so it holds
    exactly what was checked and nothing else (no comment, no second line)."""
    tree = parse_expression(text, symbols)
    mapping = rename if rename is not None else {s: SYMBOL_PREFIX + s for s in symbols}
    return "(" + ast.unparse(_Rename(mapping).visit(tree)) + ")"


NAMESPACE: Mapping[str, Any] = {"__builtins__": {}, "math": math, **_FUNCTIONS}


def compile_function(
    texts: Sequence[str], symbols: Sequence[str], *, name: str = "expressions"
) -> Callable[..., tuple[Any, ...]]:
    """One function ``f(*symbol_values) -> tuple`` evaluating every text, in order."""
    for symbol in symbols:
        check_symbol_name(symbol)
    params = ", ".join(SYMBOL_PREFIX + s for s in symbols)
    body = ", ".join(to_python(text, symbols) for text in texts)
    comma = "," if len(texts) == 1 else ""
    source = f"def {name}({params}):\n    return ({body}{comma})\n"
    namespace: dict[str, Any] = dict(NAMESPACE)
    exec(compile(source, f"<precompile {name}>", "exec"), namespace)
    function: Callable[..., tuple[Any, ...]] = namespace[name]
    return function
