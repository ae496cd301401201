"""What a model's trace read, recorded from Dynamo's own guards and checked without
Dynamo: the schema (written and read here), and its checks.

Dynamo guards every value its trace read: module attributes by value (``eps``, a
permutation tuple, a dtype), functions and classes by identity (``act = torch.relu``),
containers by type and length, hooks dicts empty, tensors aliased or not. The compile
side turns each guard into a ``Guard``: an expression over the model (``M``), the
traced ``forward``'s closure cells (``C``) and its module's globals (``G``), and a check
of the value it gives. Identity cannot cross processes, so functions, classes and
modules are checked by qualified name (plus the file and line of a function's code).

Where they are checked: every guard when a plan is bound to a model (``load_model``, a
cache hit), and again at the first call after a submodule, parameter or buffer is
registered anywhere (torch's registration hooks bump a counter); the ``training`` flags
and the environment variables (``os.environ``) the trace read on every call (a few
attribute reads each). Per call, too, every value a guard read is tested for being the
object bound (``_Reads``: the dict slot it was read from, one lookup and an identity
test each; a container's length; an instance dict a guard found without some key):
a plain attribute or a global set to another value after binding (``layer.eps = 0.5``,
``module.SCALE = 3``, a ``forward`` assigned on an instance, ``SCALES.append``) runs the
guards again, as Dynamo's guards run on every call.
"""

from __future__ import annotations

import builtins
import importlib
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter, getitem, is_not, ne
from operator import contains as _contains
from types import CellType, FunctionType, MappingProxyType
from typing import Any

import torch

from ._dtypes import dtype_name
from ._errors import CorruptArtifactError, IncompatibleArtifactError, InputMismatchError
from ._torch_adapter import hook_handles_made

# -- values as JSON --------------------------------------------------------------------


class Unencodable(Exception):
    """A value this schema cannot record (an arbitrary object's identity, say)."""


def qualified_name(value: Any) -> str:
    """``module.qualname`` of a function, builtin, class or module; a Python function's
    code place is added (two lambdas of one module share a qualname)."""
    if isinstance(value, type(sys)):
        return f"module {value.__name__}"
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if not isinstance(qualname, str):
        raise Unencodable(f"a {type(value).__name__} has no qualified name")
    module = getattr(value, "__module__", None)
    if module is None:
        owner = getattr(value, "__self__", None)
        owner_type = owner if isinstance(owner, type) else type(owner)
        module = getattr(owner_type, "__module__", None)
    name = f"{module}.{qualname}"
    code = getattr(value, "__code__", None)
    if code is not None:
        name += f" ({code.co_filename}:{code.co_firstlineno})"
    return name


def encode(value: Any) -> Any:
    """A value as tagged JSON, equal for equal values of the same type."""
    kind = type(value)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", value]
    if kind is str:
        return ["str", value]
    if kind is bytes:  # os.environ's own keys and values (``environ._data[b'FLAG']``)
        return ["bytes", value.hex()]
    if kind is float:
        return ["float", value.hex() if math.isfinite(value) else repr(value)]
    if kind in (tuple, list, torch.Size):
        return [kind.__name__, [encode(v) for v in value]]
    if isinstance(value, torch.dtype):
        return ["dtype", dtype_name(value)]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    if isinstance(value, type(Ellipsis)):
        return ["ellipsis"]
    import enum

    if isinstance(value, enum.Enum):
        return ["enum", qualified_name(type(value)), value.name]
    if kind is slice:
        return ["slice", [encode(value.start), encode(value.stop), encode(value.step)]]
    if isinstance(value, type(encode.__code__)):
        name = getattr(value, "co_qualname", value.co_name)
        return ["code", f"{name} ({value.co_filename}:{value.co_firstlineno})"]
    raise Unencodable(f"a {kind.__module__}.{kind.__qualname__} value")


def named(value: Any) -> Any:
    """What an identity guard on ``value`` checks across processes: its qualified name
    (functions, builtins, classes, modules), or its value where it is a constant."""
    if isinstance(value, (type, type(sys))) or callable(value):
        return ["named", qualified_name(value)]
    return encode(value)


def said(encoded: Any) -> str:
    """An encoded value as a person reads it."""
    if not isinstance(encoded, list) or not encoded:
        return repr(encoded)
    tag = encoded[0]
    if tag == "none":
        return "None"
    if tag == "float":
        text = encoded[1]
        return repr(float.fromhex(text)) if text not in ("inf", "-inf", "nan") else text
    if tag in ("tuple", "list", "Size"):
        inner = ", ".join(said(v) for v in encoded[1])
        return f"({inner})" if tag == "tuple" else f"[{inner}]" if tag == "list" else inner
    if tag == "dtype":
        return f"torch.{encoded[1]}"
    if tag == "bytes" and len(encoded) == 2 and isinstance(encoded[1], str):
        try:
            return repr(bytes.fromhex(encoded[1]))
        except ValueError:
            return repr(encoded[1])
    if tag in ("named", "type"):
        return str(encoded[1])
    if tag == "enum":
        return f"{encoded[1]}.{encoded[2]}"
    return repr(encoded[1]) if len(encoded) > 1 else tag


# -- expressions -----------------------------------------------------------------------
# An expression is JSON: ["M"] the model, ["C", name] a closure cell of the traced
# forward, ["G", name] a global of its module (``__import_a_dot_b`` is module ``a.b``,
# ``__builtins_dict___N`` the builtins), ["attr", e, name], ["item", e, key] (key an
# expression), ["const", encoded], ["call", fn, [e, ...]] for the few functions below.
_CALLS: dict[str, Callable[..., Any]] = {
    "type": type,
    "dict": dict,
    "list": list,
    "len": len,
    "dict.keys": dict.keys,
    "dict.__getitem__": dict.__getitem__,
}
MAX_DEPTH = 64


def _decode_constant(encoded: Any) -> Any:
    if not isinstance(encoded, list) or not encoded:
        raise CorruptArtifactError(f"guard constant {encoded!r} is not a tagged value")
    tag = encoded[0]
    if tag == "none":
        return None
    if tag in ("bool", "int", "str") and len(encoded) == 2:
        return encoded[1]
    if tag == "bytes" and len(encoded) == 2 and isinstance(encoded[1], str):
        try:
            return bytes.fromhex(encoded[1])
        except ValueError:
            pass
    raise CorruptArtifactError(f"guard constant {encoded!r} is not a key this schema uses")


@dataclass(frozen=True)
class Roots:
    """What an expression's roots stand for where it is evaluated."""

    model: Any
    closure: Mapping[str, Any]
    globals: Mapping[str, Any]


def global_value(name: str, module_globals: Mapping[str, Any]) -> Any:
    if name.startswith("__import_"):
        module_name = name.removeprefix("__import_").replace("_dot_", ".")
        module = sys.modules.get(module_name)
        if module is None:  # a module the traced code imports lazily
            module = importlib.import_module(module_name)
        return module
    if name.startswith("__builtins_dict__"):
        return builtins.__dict__
    return module_globals[name]


class _Memo(threading.local):
    """Values of expressions already evaluated in this thread's bind, by the identity of
    the expression object: a guard's path is evaluated from the model down by its
    failure check, and again, level by level, by the watch of its reads
    (``_memoized``)."""

    table: dict[int, Any] | None = None
    held: dict[int, Any] = {}  # noqa: RUF012 (per thread: set with the table)


_memo = _Memo()


@contextmanager
def _memoized() -> Iterator[None]:
    """Evaluate each expression object once while the model is not changed: one bind,
    one check again. Nested, the outer table serves."""
    if _memo.table is not None:
        yield
        return
    _memo.table, _memo.held = {}, {}
    try:
        yield
    finally:
        _memo.table, _memo.held = None, {}


def evaluate(expr: Any, roots: Roots, depth: int = 0) -> Any:
    """The value of an expression (raises on anything malformed or missing)."""
    values = _memo.table
    if values is None:
        return _evaluate(expr, roots, depth)
    key, held = id(expr), _memo.held
    if held.get(key) is expr:  # the same object, kept alive by ``held``
        return values[key]
    value = _evaluate(expr, roots, depth)
    values[key], held[key] = value, expr  # two dicts: no tuple per entry for the GC
    return value


def _evaluate(expr: Any, roots: Roots, depth: int) -> Any:
    if depth > MAX_DEPTH or not isinstance(expr, list) or not expr:
        raise CorruptArtifactError(f"guard expression {str(expr)[:80]} is malformed")
    op = expr[0]
    if op == "M":
        return roots.model
    if op == "C" and len(expr) == 2:
        return roots.closure[expr[1]]
    if op == "G" and len(expr) == 2:
        return global_value(expr[1], roots.globals)
    if op == "attr" and len(expr) == 3 and isinstance(expr[2], str):
        return getattr(evaluate(expr[1], roots, depth + 1), expr[2])
    if op == "item" and len(expr) == 3:
        return evaluate(expr[1], roots, depth + 1)[evaluate(expr[2], roots, depth + 1)]
    if op == "const" and len(expr) == 2:
        return _decode_constant(expr[1])
    if op == "call" and len(expr) == 3 and expr[1] in _CALLS and isinstance(expr[2], list):
        return _CALLS[expr[1]](*(evaluate(e, roots, depth + 1) for e in expr[2]))
    raise CorruptArtifactError(f"guard expression {str(expr)[:80]} is malformed")


def readable(expr: Any) -> str:
    """An expression as a path a person reads: ``model.model.layers.0.act``."""
    if not isinstance(expr, list) or not expr:
        return "?"
    op = expr[0]
    if op == "M":
        return "model"
    if op == "C":
        return f"<forward's closure {expr[1]}>"
    if op == "G":
        name = str(expr[1])
        if name.startswith("__import_"):
            return name.removeprefix("__import_").replace("_dot_", ".")
        return "builtins" if name.startswith("__builtins_dict__") else name
    if op == "attr":
        return f"{readable(expr[1])}.{expr[2]}"
    if op == "item":
        base, key = expr[1], expr[2]
        if (
            isinstance(base, list)
            and len(base) == 3
            and base[0] == "attr"
            and base[2] in ("_modules", "_parameters", "_buffers")
            and isinstance(key, list)
            and key[:1] == ["const"]
        ):
            return f"{readable(base[1])}.{_decode_constant(key[1])}"
        if isinstance(key, list) and key[:1] == ["const"]:
            return f"{readable(base)}[{_decode_constant(key[1])!r}]"
        return f"{readable(base)}[{readable(key)}]"
    if op == "const":
        return said(expr[1])
    if op == "call":
        return f"{expr[1]}({', '.join(readable(e) for e in expr[2])})"
    return "?"


# -- guards ----------------------------------------------------------------------------
KINDS = frozenset(
    {
        "equals",  # encode(value) == expected
        "named",  # named(value) == expected
        "type",  # qualified_name(type(value)) == expected
        "length",  # [qualified type, len(value)] == expected
        "keys",  # [encode(k) for k in value.keys()] == expected
        "empty",  # len(value) == 0
        "hasattr",  # hasattr(value, detail)
        "not_in_dict",  # detail not in vars(value)
        "contains",  # decoded detail in value
        "not_contains",
        "is",  # value is the value of expression detail
        "is_not_none",
    }
)


@dataclass(frozen=True)
class Guard:
    kind: str
    expr: Any
    expected: Any = None
    detail: Any = None

    def to_json(self) -> list[Any]:
        return [self.kind, self.expr, self.expected, self.detail]

    @staticmethod
    def from_json(value: Any) -> Guard:
        if not (isinstance(value, list) and len(value) == 4 and value[0] in KINDS):
            raise CorruptArtifactError(f"model guard {str(value)[:80]} is malformed")
        return Guard(value[0], value[1], value[2], value[3])

    def observed(self, roots: Roots) -> Any:
        """What this guard reads now, in the terms of ``expected``."""
        value = evaluate(self.expr, roots)
        kind = self.kind
        if kind == "equals":
            return encode(value)
        if kind == "named":
            return named(value)
        if kind == "type":
            return qualified_name(type(value))
        if kind == "length":
            return [qualified_name(type(value)), len(value)]
        if kind == "keys":
            return dict_keys(value)
        if kind == "empty":
            return len(value) == 0
        if kind == "hasattr":
            return hasattr(value, str(self.detail))
        if kind == "not_in_dict":
            return str(self.detail) not in getattr(value, "__dict__", {})
        if kind in ("contains", "not_contains"):
            present = _decode_constant(self.detail) in value
            return present if kind == "contains" else not present
        if kind == "is":
            return value is evaluate(self.detail, roots)
        if kind == "is_not_none":
            return value is not None
        raise CorruptArtifactError(f"model guard kind {kind!r} is unknown")

    def failure(self, roots: Roots) -> str | None:
        """Why the guard fails here, naming its path and both values; None if it holds."""
        try:
            now = self.observed(roots)
        except (CorruptArtifactError, InputMismatchError):
            raise
        except Unencodable as exc:  # a value of a type the trace's value did not have
            return f"{readable(self.expr)} is {exc}, compiled with {said(self.expected)}"
        except Exception as exc:  # a missing attribute or key: the model differs there
            if self.expr[:1] == ["C"] and isinstance(exc, KeyError):
                return f"{readable(self.expr)} is an empty cell (deleted), compiled with a value"
            return f"{readable(self.expr)} cannot be read ({type(exc).__name__}: {exc})"
        if now == self.expected:
            return None
        path = readable(self.expr)
        if self.kind in ("equals", "named"):
            return f"{path} is {said(now)}, compiled with {said(self.expected)}"
        if self.kind == "type":
            why = ""
            if path.endswith("._modules"):  # torch rebuilds it so on ``del layers[i]``
                why = (" (a ModuleList or Sequential rebuilds its registry so when an item is "
                       "deleted: compile the model again after such an edit)")  # fmt: skip
            return f"{path} is a {now}, compiled with a {self.expected}{why}"
        if self.kind == "length":
            return f"{path} is a {now[0]} of length {now[1]}, compiled with " \
                f"a {self.expected[0]} of length {self.expected[1]}"  # fmt: skip
        if self.kind == "keys":
            return f"{path} has keys {said(['list', now])}, compiled with " \
                f"{said(['list', self.expected])}"  # fmt: skip
        if self.kind == "empty":
            return f"{path} is not empty (hooks registered?), compiled with it empty"
        if self.kind == "hasattr":
            if self.expected:
                return f"{path} has no attribute {self.detail!r}, compiled with one"
            return f"{path} has an attribute {self.detail!r}, compiled without one"
        if self.kind == "not_in_dict":
            return f"{path} has {self.detail!r} in its instance dict, compiled without"
        if self.kind in ("contains", "not_contains"):
            return f"{path} {'lacks' if self.kind == 'contains' else 'has'} key " \
                f"{_decode_constant(self.detail)!r}, compiled otherwise"  # fmt: skip
        if self.kind == "is":
            return f"{path} is not the same object as {readable(self.detail)} (compiled tied)"
        return f"{path} is None, compiled with a value"


@dataclass(frozen=True)
class TraceRead:
    """Everything a model's trace read that a plan checks: the guards, the process-wide
    state (``precompile.runtime._global_state``), the traced forward (to find its closure and
    module), and the guards no check here covers (by path: said, never hidden)."""

    guards: tuple[Guard, ...]
    state: Mapping[str, Any]
    forward: str  # qualified_name of the traced forward function
    unchecked: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "guards": [g.to_json() for g in self.guards],
            "state": dict(self.state),
            "forward": self.forward,
            "unchecked": list(self.unchecked),
        }

    @staticmethod
    def from_json(value: Any) -> TraceRead:
        if not isinstance(value, dict):
            raise CorruptArtifactError("model plan field trace_read is not an object")
        guards, state = value.get("guards"), value.get("state")
        forward, unchecked = value.get("forward"), value.get("unchecked", [])
        if not isinstance(guards, list) or not isinstance(state, dict):
            raise CorruptArtifactError("model plan field trace_read is malformed")
        if not isinstance(forward, str) or not isinstance(unchecked, list):
            raise CorruptArtifactError("model plan field trace_read is malformed")
        return TraceRead(
            tuple(Guard.from_json(g) for g in guards),
            state,
            forward,
            tuple(str(u) for u in unchecked),
        )


def traced_forward(model: torch.nn.Module) -> Any:
    """The function Dynamo traces for ``model(...)``: its class's ``forward``."""
    return type(model).forward


class ClosureCells(Mapping[str, Any]):
    """A function's closure by name, read live: a cell set again after binding
    (``nonlocal scale; scale = 3.0``) is what a guard reads next, not the value the
    cell held at the bind. Empty cells are absent."""

    def __init__(self, function: Any) -> None:
        code = getattr(function, "__code__", None)
        cells = getattr(function, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        self._cells: dict[str, CellType] = dict(zip(names, cells, strict=False))

    def cell(self, name: str) -> CellType:
        return self._cells[name]

    def __getitem__(self, name: str) -> Any:
        try:
            return self._cells[name].cell_contents
        except ValueError:  # an empty cell
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._cells if name in self)

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __len__(self) -> int:
        return sum(1 for _ in self)


def roots_of(model: torch.nn.Module, forward: Any) -> Roots:
    return Roots(model, ClosureCells(forward), getattr(forward, "__globals__", {}))


def dict_keys(value: Any) -> list[Any]:
    """A dict's keys as a keys guard compares them; torch's global registration-hook
    dicts without this module's own hook (which a bound model installs, see below)."""
    if isinstance(value, dict):
        return [encode(k) for k, v in value.items() if v is not _on_registration]
    return [encode(k) for k in value]


def _reads_environ(expr: Any) -> bool:
    """Whether a guard's expression reads a module's ``environ`` (``os.environ``): the
    process's environment, which changes under a bound model, so it is checked per
    call like the training flags."""
    if not isinstance(expr, list) or not expr:
        return False
    if expr[0] == "attr" and len(expr) == 3 and expr[2] == "environ":
        return isinstance(expr[1], list) and expr[1][:1] == ["G"]
    return any(_reads_environ(part) for part in expr[1:] if isinstance(part, list))


_DEFAULTS = ("__defaults__", "__kwdefaults__")


def _defaults_read(expr: Any) -> list[Any]:
    """The ``[attr, function, __defaults__ or __kwdefaults__]`` reads in a guard's
    expression: a forward's defaults the call left, which the trace read."""
    if not isinstance(expr, list) or not expr:
        return []
    if expr[0] == "attr" and len(expr) == 3 and expr[2] in _DEFAULTS:
        return [expr]
    return [read for part in expr[1:] if isinstance(part, list) for read in _defaults_read(part)]


class _DefaultsSeen:
    """A function's defaults (its ``__defaults__`` or ``__kwdefaults__`` object) as last
    checked, and the guards that read them: per call, one identity test; the guards
    run again only where the object was replaced."""

    __slots__ = ("attribute", "function", "guards", "seen")

    def __init__(self, function: Any, attribute: str, guards: list[Guard]) -> None:
        self.function = function
        self.attribute = attribute
        self.guards = guards
        self.seen = getattr(function, attribute, None)


_MISSING = object()


# A module's own bookkeeping dicts: the objects are never replaced (what they hold
# changes through registration, which the hooks below see, and hooks dicts are watched
# by their length).
_MODULE_DICTS = frozenset(
    {"_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",
     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
     "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"}
)  # fmt: skip


_REGISTERED = ("_modules", "_parameters", "_buffers")


def _registered(owner: Any, name: Any) -> bool:
    """Whether ``name`` is a submodule, parameter or buffer of the module ``owner``: an
    instance attribute cannot shadow those (``Module.__setattr__`` moves a value given
    that name into its registry), and registering is what torch's hooks report."""
    return isinstance(owner, torch.nn.Module) and any(
        name in getattr(owner, held, {}) for held in _REGISTERED
    )


class _Reads:
    """Where the guards' values live, as bound: per call each slot must still hold the
    object bound there (a guard that read ``layer.eps`` watches ``vars(layer)["eps"]``),
    each closure cell read its object, each container its length (and a dict the forward
    iterated its key order), and each instance dict the guards found without a key
    (no ``forward`` set on the instance) must still lack it. A difference is no failure
    by itself (an equal value set again): it sends the guards to be checked again.

    A submodule the trace read is watched in its parent's registry (``_modules``), and
    the registry in its owner: no registration hook reports ``del m.act``,
    ``m._modules[k] = v`` or a registry replaced. Not watched here:
    hooks dicts the guards found empty (a hook registered anywhere makes a hook handle,
    whose count is watched instead) and a module's parameters and buffers (registering
    one is what torch's hooks report; a deleted one is refused where the call reads it).
    The test is one generated function of C-level passes over the slots, for speed:
    20.8 us per call for a 2-layer tiny Llama, 58.8 us for 32 layers
    (docs/benchmarks.md, "Dispatch overhead")."""

    __slots__ = ("changed", "forwards", "functions", "made", "modules", "shadows")

    def __init__(self, guards: Sequence[Guard], roots: Roots) -> None:
        slots: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}
        items: dict[tuple[int, int], tuple[Any, int, Any]] = {}
        lengths: dict[int, tuple[Any, int]] = {}
        shadows: dict[tuple[int, Any], tuple[type, Any]] = {}
        cells: dict[int, tuple[CellType, Any]] = {}
        orders: dict[int, tuple[dict[Any, Any], tuple[Any, ...]]] = {}
        for guard in guards:
            try:
                self._watch(guard, roots, slots, items, lengths, shadows, cells, orders)
            except Exception:  # nothing to watch there: the bind checked it
                continue

        def slot(mapping: Any, key: Any) -> None:
            _slot(slots, mapping, key)

        # each module class's forward where it is defined (Dynamo guards none of them:
        # ``Sub.forward = other`` after binding would be served the traced code)
        forwards: list[tuple[type, Any]] = []
        if isinstance(roots.model, torch.nn.Module):
            for cls in {type(m) for m in roots.model.modules()}:
                _class_slot(cls, "forward", slot)
                forwards.append((cls, cls.forward))
        self.forwards = tuple(forwards)
        self.shadows = tuple(shadows.values())
        # a function's code, which a ``named`` guard checks by name and line only
        for *_, value in list(slots.values()):
            if isinstance(value, FunctionType):
                items.setdefault((id(value), -1), (value, -1, value.__code__))
        # where a function was read (a slot, a closure cell): another function set there
        # passes a ``named`` guard when it has the same name and line (two lambdas of one
        # line), so a check again compares its code with the one bound
        self.functions = tuple(
            (place, key, value)
            for place, key, value in (*slots.values(), *((c, None, v) for c, v in cells.values()))
            if isinstance(value, FunctionType)
        )
        # modules the forward reads from outside the model (a closure cell's, a global's):
        # a registration in one of them binds the model again, as one in the model does
        held = [*(v for *_, v in slots.values()), *(v for _, v in cells.values()),
                *(v for *_, v in items.values())]  # fmt: skip
        self.modules = tuple(v for v in held if isinstance(v, torch.nn.Module))
        self.made = hook_handles_made()
        self.changed = self._test(
            list(slots.values()), list(items.values()), list(lengths.values()),
            list(cells.values()), list(orders.values()), self.made,
        )  # fmt: skip

    def hooked(self) -> bool:
        """Whether a hook was registered anywhere since (the one read kept per call by
        ``skip_guard_eval_unsafe()``)."""
        return hook_handles_made() != self.made

    @staticmethod
    def _test(slots: list[tuple[Any, Any, Any]], items: list[tuple[Any, int, Any]],
              lengths: list[tuple[Any, int]], cells: list[tuple[CellType, Any]],
              orders: list[tuple[dict[Any, Any], tuple[Any, ...]]],
              made: int) -> Callable[[], bool]:  # fmt: skip
        """``changed()``: whether any slot, list item or closure cell holds another object,
        any container has another length, or any dict the forward iterated has its keys in
        another order (the values are the function's default arguments, never source text;
        an emptied cell raises: changed)."""
        names: dict[str, Any] = {"_MISSING": _MISSING, "_handles": hook_handles_made,
                                 "_made": made, "_any": any, "_map": map,
                                 "_is_not": is_not}  # fmt: skip
        terms = ["_handles() != _made"]  # a hook registered anywhere since
        # C-level passes, no bytecode per slot: the keys each dict held, read (a key gone
        # raises: a change) and compared by identity (-0.0 is not 0.0); the keys each
        # lacked, tested with ``in``; each function's code object, by identity.
        held = [(m, k, v) for m, k, v in slots if v is not _MISSING]
        lacked = [(m, k) for m, k, v in slots if v is _MISSING]
        functions = [(f, code) for f, index, code in items if index < 0]
        listed = [(seq, index, value) for seq, index, value in items if index >= 0]
        names.update({
            "_getitem": getitem, "_contains": _contains, "_code": attrgetter("__code__"),
            "_held": tuple(m for m, _, _ in held), "_keys": tuple(k for _, k, _ in held),
            "_values": tuple(v for _, _, v in held),
            "_lacking": tuple(m for m, _ in lacked), "_lacked": tuple(k for _, k in lacked),
            "_functions": tuple(f for f, _ in functions),
            "_codes": tuple(c for _, c in functions),
            "_contents": attrgetter("cell_contents"),
            "_cells": tuple(c for c, _ in cells), "_held_by_cells": tuple(v for _, v in cells),
            "_ne": ne, "_tuple": tuple, "_ordered": tuple(d for d, _ in orders),
            "_orders": tuple(keys for _, keys in orders),
        })  # fmt: skip
        terms += [
            "_any(_map(_is_not, _map(_getitem, _held, _keys), _values))",
            "_any(_map(_contains, _lacking, _lacked))",
            "_any(_map(_is_not, _map(_code, _functions), _codes))",
            "_any(_map(_is_not, _map(_contents, _cells), _held_by_cells))",
            "_any(_map(_ne, _map(_tuple, _ordered), _orders))",
        ]
        for n, (sequence, index, value) in enumerate(listed):
            names.update({f"s{n}": sequence, f"i{n}": index, f"w{n}": value})
            terms.append(f"(len(s{n}) <= i{n} or s{n}[i{n}] is not w{n})")
        for n, (container, length) in enumerate(lengths):
            names.update({f"c{n}": container, f"n{n}": length})
            terms.append(f"len(c{n}) != n{n}")
        parameters = ", ".join(f"{name}={name}" for name in names)
        # a key gone, or a comparison that raises (a tensor set in a value's place): changed
        source = (
            f"def changed({parameters}):\n    try:\n        return bool("
            + " or ".join(terms)
            + ")\n    except Exception:\n        return True\n"
        )
        scope: dict[str, Any] = {}
        exec(compile(source, "<precompile guard reads>", "exec"), dict(names), scope)
        changed: Callable[[], bool] = scope["changed"]
        return changed

    @staticmethod
    def _watch(guard: Guard, roots: Roots, slots: dict[tuple[int, Any], tuple[Any, Any, Any]],
               items: dict[tuple[int, int], tuple[Any, int, Any]],
               lengths: dict[int, tuple[Any, int]],
               shadows: dict[tuple[int, Any], tuple[type, Any]],
               cells: dict[int, tuple[CellType, Any]],
               orders: dict[int, tuple[dict[Any, Any], tuple[Any, ...]]]) -> None:  # fmt: skip
        def slot(mapping: Any, key: Any) -> None:
            if key not in _MODULE_DICTS:
                _slot(slots, mapping, key)

        def read(expr: Any) -> None:
            """Every read of ``expr``, the ones its value was reached through included
            (a global rebound to a new list, whose item the guard reads)."""
            if not isinstance(expr, list) or not expr:
                return
            op = expr[0]
            if op == "C" and isinstance(roots.closure, ClosureCells):  # a closure cell
                cell = roots.closure.cell(expr[1])
                cells.setdefault(id(cell), (cell, cell.cell_contents))
            elif op == "G" and not str(expr[1]).startswith(("__import_", "__builtins_dict__")):
                slot(roots.globals, expr[1])
            elif op == "attr":
                read(expr[1])
                owner = evaluate(expr[1], roots)
                if isinstance(owner, CellType) and expr[2] == "cell_contents":
                    cells.setdefault(id(owner), (owner, owner.cell_contents))
                    return  # a cell of a function the forward calls
                if _registered(owner, expr[2]):
                    return  # a submodule, parameter or buffer: the registration hooks
                own = getattr(owner, "__dict__", None)
                slot(own, expr[2])  # set on the instance later: a value of its own
                if not (isinstance(own, dict) and expr[2] in own):
                    _class_slot(type(owner), expr[2], slot)
            elif op == "item" and isinstance(expr[2], list) and expr[2][:1] == ["const"]:
                base = expr[1]
                if isinstance(base, list) and base[:1] == ["attr"] and base[2] in _REGISTERED:
                    read(base[1])
                    if base[2] == "_modules":
                        # what the registration hooks do not see: a submodule deleted
                        # (``del m.act``) or set in the registry itself (torch's own
                        # quantization ``convert`` does ``m._modules[k] = v``), or the
                        # registry replaced (``ModuleList.__delitem__`` makes a new one)
                        owner = evaluate(base[1], roots)
                        _slot(slots, getattr(owner, "__dict__", None), "_modules")
                        _slot(slots, evaluate(base, roots), _decode_constant(expr[2][1]))
                    return  # a module's registry: the registration hooks see its entries
                if isinstance(base, list) and base[:2] == ["call", "dict"] and len(base[2]) == 1:
                    base = base[2][0]  # dict(type(m).__dict__)[k]: the class's own dict
                    for passed, name in _shadowing_classes(base, expr[2], roots):
                        slot(passed.__dict__, name)
                        shadows.setdefault((id(passed), name), (passed, name))
                read(base)
                container, key = evaluate(base, roots), _decode_constant(expr[2][1])
                if isinstance(container, list) and isinstance(key, int) and key >= 0:
                    items.setdefault((id(container), key), (container, key, container[key]))
                else:
                    slot(container, key)
            elif op == "call" and isinstance(expr[2], list):
                for argument in expr[2]:
                    read(argument)

        expr = guard.expr
        value = evaluate(expr, roots)
        if guard.kind in ("hasattr", "not_in_dict") and not _registered(value, guard.detail):
            slot(getattr(value, "__dict__", None), str(guard.detail))
        if guard.kind == "empty" and expr[0] == "attr" and "hooks" in str(expr[2]):
            return  # a registration makes a hook handle: the count of those is watched
        if guard.kind in ("length", "keys", "empty") and isinstance(value, (list, dict)):
            lengths.setdefault(id(value), (value, len(value)))
        if guard.kind == "keys" and isinstance(value, dict):  # iterated: its order too
            orders.setdefault(id(value), (value, tuple(value)))
        if guard.kind in ("contains", "not_contains"):  # a key's presence ("FLAG" in environ)
            slot(value, _decode_constant(guard.detail))
        read(expr)


def _held_at(place: Any, key: Any) -> Any:
    """What a function slot holds now: ``place[key]``, or a closure cell's contents
    (``key`` None); ``_MISSING`` where it is gone."""
    try:
        return place.cell_contents if key is None else place[key]
    except (KeyError, ValueError, TypeError):
        return _MISSING


def _slot(slots: dict[tuple[int, Any], tuple[Any, Any, Any]], mapping: Any, key: Any) -> None:
    """Watch ``mapping[key]`` (or its absence) as it is now, once per dict and key."""
    if isinstance(mapping, (dict, MappingProxyType)):
        slots.setdefault((id(mapping), key), (mapping, key, mapping.get(key, _MISSING)))


def _shadowing_classes(base: Any, key: Any, roots: Roots) -> list[tuple[type, Any]]:
    """For a class attribute Dynamo read from the class that defines it
    (``dict(type(m).__mro__[1].__dict__)['K']``): the classes the lookup passes first,
    which must still lack it (a subclass given its own ``K`` shadows the one read, and
    no guard of Dynamo's says so)."""
    path = base[1] if isinstance(base, list) and base[:1] == ["attr"] else None
    if not (isinstance(path, list) and path[:1] == ["item"] and path[2][:1] == ["const"]):
        return []
    mro = evaluate(path[1], roots)
    position = _decode_constant(path[2][1])
    if not (isinstance(mro, tuple) and isinstance(position, int)):
        return []
    return [(passed, _decode_constant(key[1])) for passed in mro[:position]]


def _class_slot(cls: type, name: str, slot: Callable[[Any, Any], None]) -> None:
    """Watch a class attribute where the class hierarchy defines it: not a builtin type's,
    nor a descriptor of the instance's state (a cell's contents, a function's defaults:
    watched elsewhere)."""
    before: list[type] = []  # the classes the lookup passes first: one setting it there shadows it
    for defining in cls.__mro__:
        if name in defining.__dict__:
            found = defining.__dict__[name]
            data = hasattr(type(found), "__set__") or hasattr(type(found), "__delete__")
            if defining.__module__ != "builtins" and not data:
                slot(defining.__dict__, name)
                for passed in before:
                    slot(passed.__dict__, name)
            return
        before.append(defining)


def _is_training_flag(guard: Guard) -> bool:
    expr = guard.expr
    return (
        guard.kind == "equals"
        and isinstance(expr, list)
        and len(expr) == 3
        and expr[0] == "attr"
        and expr[2] == "training"
    )


# Bumped by torch's registration hooks when a module of a bound model registers a
# submodule, parameter or buffer (assignment included): the next call of a bound model
# checks its guards again. Not inside a Dynamo trace: a registration there is of a
# module the trace made, and Dynamo would otherwise guard on the counter.
_generation = [0]
_tracked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_hooks_lock = threading.Lock()
_hooks_installed = False


def _on_registration(module: Any, name: Any, value: Any) -> None:
    if torch.compiler.is_compiling():
        return
    if module in _tracked:
        _generation[0] += 1


def _install_registration_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        from torch.nn.modules import module as module_module

        module_module.register_module_module_registration_hook(_on_registration)
        module_module.register_module_parameter_registration_hook(_on_registration)
        module_module.register_module_buffer_registration_hook(_on_registration)
        _hooks_installed = True


class BoundGuards:
    """A ``TraceRead`` bound to one model: every guard checked now (``bind``), the
    training flags per call, and everything again after a registration anywhere."""

    def __init__(self, read: TraceRead, model: torch.nn.Module, where: str) -> None:
        self.read = read
        self.model = model
        self.where = where
        forward = traced_forward(model)
        try:
            name = qualified_name(forward)
        except Unencodable:
            name = repr(forward)
        if name != read.forward:
            raise IncompatibleArtifactError(
                f"{where} traced {read.forward}, but this model's forward is {name}"
            )
        # what each guard's expression reads of the environment and of defaults, found
        # once (its repr, a walk in C, says which expressions to walk in Python)
        self._environment: list[Guard] = []
        self._defaults_reads: list[tuple[Guard, list[Any]]] = []
        for guard in read.guards:
            text = repr(guard.expr)
            if "'environ'" in text and _reads_environ(guard.expr):
                self._environment.append(guard)
            if "defaults__'" in text and (reads := _defaults_read(guard.expr)):
                self._defaults_reads.append((guard, reads))
        self.roots = roots_of(model, forward)
        self._flags: list[tuple[Any, bool, Guard]] = []
        self.reads_per_call = True  # False: CompiledModel.skip_guard_eval_unsafe()
        _install_registration_hooks()
        self.bind()

    def bind(self) -> None:
        """Check every guard against the model now; refuse with the first failures."""
        with _memoized():
            self._bind()

    def _bind(self) -> None:
        failures = self._failures()
        if failures:
            raise IncompatibleArtifactError(
                f"{self.where} does not fit this model: its trace read {failures}. Load it "
                "with the model it was compiled from, or compile this one"
            )
        swapped = self._swapped_functions()
        if swapped:
            raise IncompatibleArtifactError(swapped)
        flags = []
        for guard in self.read.guards:
            if _is_training_flag(guard):
                owner = evaluate(guard.expr[1], self.roots)
                flags.append((owner, guard.expected == ["bool", True], guard))
        self._flags = flags
        defaults: dict[tuple[int, str], _DefaultsSeen] = {}
        for guard, reads in self._defaults_reads:
            for read in reads:
                try:
                    function = evaluate(read[1], self.roots)
                except Exception:  # nothing to watch per call: the bind checked it
                    continue
                key = (id(function), read[2])
                if key not in defaults:
                    defaults[key] = _DefaultsSeen(function, read[2], [])
                defaults[key].guards.append(guard)
        self._defaults = list(defaults.values())
        self._reads = _Reads(self.read.guards, self.roots)
        self._track()

    def _track(self) -> None:
        """The registration hooks' watch: the model's modules and those it reads."""
        _tracked.update(self.model.modules())
        for held in self._reads.modules:
            _tracked.update(held.modules())
        self._generation = _generation[0]

    def _check_again(self) -> None:
        """Every guard, where a value one read was set again since the last check:
        refused naming what differs, or (set to an equal value) watched as it is now.
        The environment first: its variables live in ``os.environ``'s dict, watched as
        any other, and a change there is said as one."""
        for guard in self._environment:
            failure = guard.failure(self.roots)
            if failure is not None:
                raise InputMismatchError(
                    f"the environment changed under {self.where}: {failure}; its forward "
                    "read it, so it holds for the traced value alone: set it back or "
                    "compile again"
                )
        failures = self._failures()
        if failures:
            raise InputMismatchError(
                f"the model changed under {self.where} after it was bound: its trace read "
                f"{failures}; set it back or compile the model again"
            )
        swapped = self._swapped_functions()
        if swapped:
            raise InputMismatchError(swapped)
        replaced = [f"{qualified_name(cls)}.forward" for cls, forward in self._reads.forwards
                    if getattr(cls, "forward", None) is not forward]  # fmt: skip
        replaced += [
            f"{qualified_name(cls)}.{name} (set where the class it was read from is shadowed)"
            for cls, name in self._reads.shadows
            if name in cls.__dict__
        ]
        if replaced:
            raise InputMismatchError(
                f"{', '.join(sorted(replaced))} was replaced on its class after "
                f"{self.where} was bound (its graph runs what it traced); set it back or "
                "compile the model again"
            )
        self._reads = _Reads(self.read.guards, self.roots)
        self._track()

    def _swapped_functions(self) -> str:
        """Functions set since the last bind where the trace read one, with the same name
        and line (which is all a ``named`` guard compares) but other code, said; "" where
        none is."""
        reads: _Reads | None = getattr(self, "_reads", None)
        swapped = [
            f"{key!r} (now {qualified_name(now)})" if key is not None else qualified_name(now)
            for place, key, bound in (reads.functions if reads is not None else ())
            if isinstance(now := _held_at(place, key), FunctionType)
            and now is not bound
            and now.__code__ != bound.__code__
        ]
        if not swapped:
            return ""
        return (
            f"a function {self.where} traced was replaced after binding by one of the same "
            f"name and line with other code: {', '.join(swapped)}; its graph runs what it "
            "traced, so set it back or compile the model again"
        )

    def _failures(self) -> str:
        """The first three guards that fail now, said ("" where every one holds)."""
        failures: list[str] = []
        unreadable: list[tuple[str, str]] = []  # (path, why): said once, not again for
        for guard in self.read.guards:  # every path through it that fails the same way
            failure = guard.failure(self.roots)
            if failure is None or failure in failures:
                continue
            path, _, why = failure.partition(" cannot be read ")
            if why:
                if any(p in path and w == why for p, w in unreadable):  # type(p).forward
                    continue
                unreadable.append((path, why))
            failures.append(failure)
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        return "; ".join(failures[:3]) + more if failures else ""

    def check(self) -> bool:
        """Per call: the training flags and the defaults the trace read, every value the
        guards read still the one bound (``_Reads``; the environment among them; unless
        ``reads_per_call`` is off), and a new bind after a registration in a bound model
        since the last one. True after that bind, or after a value read changed and every
        guard held again (another submodule set in its registry, say): what was resolved
        from the model, its weights' owners, must be resolved again."""
        rebound = self._generation != _generation[0]
        if rebound:
            self.bind()
        for owner, training, guard in self._flags:
            if owner.training is not training:
                raise InputMismatchError(
                    f"{readable(guard.expr)} is {owner.training}, but {self.where} was "
                    f"traced with it {training}; switch it back (.train()/.eval()) or "
                    "compile the model in this mode",
                    expected=training,
                    got=owner.training,
                )
        reads = self._reads
        if not rebound and (reads.changed() if self.reads_per_call else reads.hooked()):
            with _memoized():
                self._check_again()
            rebound = True  # a submodule set in its registry, say: resolve the weights again
        for read in self._defaults:
            now = getattr(read.function, read.attribute, None)
            if now is read.seen:
                continue
            for guard in read.guards:
                failure = guard.failure(self.roots)
                if failure is not None:
                    raise InputMismatchError(
                        f"a default of {self.where}'s forward changed after binding: "
                        f"{failure}; the trace used the default the call left, so pass the "
                        "argument, set the default back or compile again"
                    )
            read.seen = now
        return rebound
