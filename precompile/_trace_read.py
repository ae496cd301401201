"""Dynamo's guards of a model's trace, turned into the checks a compiled model carries
(``precompile.runtime._model_guards``): what the trace read is what a load checks.

Each guard reads a source, a Python expression over the traced frame's locals (``L``)
and globals (``G``). Here it is parsed into the runtime's expression schema, with the
model itself (``L['self']``, ``L['args'][0]`` in a decorated forward, or ``L['fn']`` in
the frame Dynamo wraps around torch.nn's own modules) as the root ``M`` and the
forward's closure cells as ``C``; then each guard is checked once against
the traced call, so a guard that this translation reads wrongly is never recorded as if
it held. What is left, and why:
- guards on the call's own arguments: the plan checks those per call (structure,
  constants, the input contract of every tensor, a KV cache's layout);
- the process-wide state guards: ``precompile.runtime._global_state`` records and checks them;
- tensor guards on parameters and buffers: the input contract, per call;
- Dynamo's symbolic-shape guards: the variants' own guards;
- guards on Dynamo's and inductor's own modules (its polyfills), which no model sets;
- anything this schema cannot express: named in the plan's ``unchecked`` list and in
  a warning at compile time, never dropped silently.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from precompile.runtime.compiler_interface import (
    Guard,
    TraceRead,
    Unencodable,
    qualified_name,
    trace_state,
    traced_forward,
)
from precompile.runtime.compiler_interface import GuardRoots as Roots
from precompile.runtime.compiler_interface import encode_guard_value as encode
from precompile.runtime.compiler_interface import guard_identity as named
from precompile.runtime.compiler_interface import guard_roots as roots_of
from precompile.runtime.compiler_interface import guarded_dict_keys as dict_keys
from precompile.runtime.compiler_interface import readable_guard_expr as readable

log = logging.getLogger("precompile.compile")

# Dynamo guard types the per-call checks elsewhere cover (see the module docstring).
_STATE_GUARDS = frozenset(
    {"GRAD_MODE", "GLOBAL_STATE", "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE",
     "DEFAULT_DEVICE"}
)  # fmt: skip
_COVERED_ELSEWHERE = frozenset({"SHAPE_ENV", "TENSOR_MATCH"}) | _STATE_GUARDS
_NAMED = frozenset(
    {"ID_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "CLOSURE_MATCH",
     "FUNCTION_MATCH"}
)  # fmt: skip
_LENGTH = frozenset({"SEQUENCE_LENGTH", "LIST_LENGTH", "TUPLE_ITERATOR_LEN", "DICT_LENGTH"})
_KEYS = frozenset({"DICT_KEYS_MATCH", "DICT_KEYS", "MAPPING_KEYS_CHECK"})
_COMPILER_MODULES = ("__import_torch_dot__dynamo", "__import_torch_dot__inductor",
                     "__import_torch_dot__functorch")  # fmt: skip


class _Untranslatable(Exception):
    pass


def parse_source(text: str) -> Any:
    """A guard source (``L['self']._modules['a'].eps``) as a runtime expression over
    ``L``/``G`` (``["L", name]`` roots are resolved by ``_rooted``)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise _Untranslatable(f"unparsable source {text!r}") from exc
    return _expr(tree)


def _expr(node: ast.AST) -> Any:
    if isinstance(node, ast.Subscript):
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("L", "G"):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return [base.id, key.value]
            raise _Untranslatable("a root subscript that is not a name")
        return ["item", _expr(base), _expr(node.slice)]
    if isinstance(node, ast.Attribute):
        return ["attr", _expr(node.value), node.attr]
    if isinstance(node, ast.Constant):
        try:
            return ["const", encode(node.value)]
        except Unencodable as exc:
            raise _Untranslatable(str(exc)) from exc
    if isinstance(node, ast.Call) and not node.keywords:
        func = node.func
        if isinstance(func, ast.Name):
            name = func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            name = f"{func.value.id}.{func.attr}"
        else:
            raise _Untranslatable("a call of an expression")
        if name not in ("type", "dict", "list", "len", "dict.keys", "dict.__getitem__"):
            raise _Untranslatable(f"a call of {name}")
        return ["call", name, [_expr(a) for a in node.args]]
    if isinstance(node, ast.Name):  # a local of the frame, without L[...] (older torch)
        return ["L", node.id]
    raise _Untranslatable(f"a {type(node).__name__} in a source")


def _frame_locals(
    model: torch.nn.Module, forward: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The traced frame's locals at its start: the forward's bound arguments (defaults
    applied) and its closure cells."""
    bound = inspect.signature(forward, follow_wrapped=False).bind(model, *args, **kwargs)
    bound.apply_defaults()
    found = dict(bound.arguments)
    found.update(roots_of(model, forward).closure)
    return found


def _defaulted(
    model: torch.nn.Module, forward: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The forward's parameters the call left to their defaults, each as the expression
    that reads its default off the model's forward (``M.forward.__defaults__[i]``, or
    ``__kwdefaults__[name]`` for a keyword-only one): a guard on such a local reads the
    default, which the call's checks never see (a changed default was served the traced
    one)."""
    signature = inspect.signature(forward, follow_wrapped=False)
    passed = signature.bind(model, *args, **kwargs).arguments
    # the traced function, from the model's forward through its decorators' __wrapped__
    method: Any = ["attr", ["M"], "forward"]
    current = getattr(model, "forward", None)
    for _ in range(8):
        if getattr(getattr(current, "__func__", current), "__code__", None) is forward.__code__:
            break
        current = getattr(current, "__wrapped__", None)
        if current is None:
            return {}  # not reachable by attributes: such guards stay unchecked, named
        method = ["attr", method, "__wrapped__"]
    else:
        return {}
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty
    ]
    found: dict[str, Any] = {}
    for index, name in enumerate(positional):
        if name not in passed:
            found[name] = ["item", ["attr", method, "__defaults__"], ["const", encode(index)]]
    for parameter in signature.parameters.values():
        defaulted = parameter.default is not parameter.empty and parameter.name not in passed
        if parameter.kind is parameter.KEYWORD_ONLY and defaulted:
            key = ["const", encode(parameter.name)]
            found[parameter.name] = ["item", ["attr", method, "__kwdefaults__"], key]
    return found


def _wrapper_locals(
    model: torch.nn.Module, wrapper: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The locals of Dynamo's own frame around the model (``adapter.top_frame_wrapper``) at
    its start: its bound arguments (the call's) and those of its closure cells that hold
    the model. Any other cell is left out: a guard reading it is untranslatable."""
    bound = inspect.signature(wrapper, follow_wrapped=False).bind(*args, **kwargs)
    bound.apply_defaults()
    found = dict(bound.arguments)
    cells = roots_of(model, wrapper).closure
    holding = [name for name, value in cells.items() if value is model]
    if not holding:
        raise _unsupported(
            f"Dynamo traced its wrapper {qualified_name(wrapper)} around the model, but no "
            "closure cell of it holds the model"
        )
    found.update((name, model) for name in holding)
    return found


def _module_globals_only(expr: Any) -> None:
    """In a trace whose top frame is Dynamo's wrapper, a global of the frame is one of
    Dynamo's module (``external_utils``), not of the forward's: only the modules and
    builtins Dynamo names by themselves (``G['__import_torch_dot_nn_dot_functional']``,
    which inlined code reads its globals through) mean the same in another process."""
    if not isinstance(expr, list) or not expr or expr[0] == "const":
        return
    if expr[0] == "G":
        name = str(expr[1])
        if not name.startswith(("__import_", "__builtins_dict__")):
            raise _Untranslatable(
                f"reads global {name} of Dynamo's wrapper frame, not of the model's forward"
            )
        return
    for part in expr[1:]:
        _module_globals_only(part)


def _rooted(expr: Any, model: Any, frame: Mapping[str, Any], closure: Mapping[str, Any],
            roots: Roots, defaults: Mapping[str, Any] | None = None,
            ) -> tuple[Any, bool]:  # fmt: skip
    """``expr`` with the model as ``M``, closure cells as ``C`` and parameters the call
    left to their defaults as reads of those defaults (``defaults``), and whether what is
    left reads a call argument (a local that is none of these)."""
    if not isinstance(expr, list):
        return expr, False
    op = expr[0]
    if op == "L":
        name = expr[1]
        if name not in frame:
            raise _Untranslatable(f"local {name} is not the traced frame's")
        if frame[name] is model:
            return ["M"], False
        if name in closure:
            return ["C", name], False
        if defaults and name in defaults:
            return defaults[name], False
        return expr, True
    if op in ("G", "const", "M", "C"):
        return expr, False
    if op == "item":
        base, call_base = _rooted(expr[1], model, frame, closure, roots, defaults)
        key, call_key = _rooted(expr[2], model, frame, closure, roots, defaults)
        rooted = ["item", base, key]
        if base[:1] == ["L"] and key[:1] == ["const"]:
            # ``L['args'][0]`` in a forward taking *args: the model, if that is its value
            try:
                value = frame[base[1]][_constant(key[1])]
            except (LookupError, TypeError):
                value = None
            if value is model:
                return ["M"], False
        return rooted, call_base or call_key
    if op == "attr":
        base, call = _rooted(expr[1], model, frame, closure, roots, defaults)
        return ["attr", base, expr[2]], call
    if op == "call":
        parts = [_rooted(e, model, frame, closure, roots, defaults) for e in expr[2]]
        return ["call", expr[1], [p for p, _ in parts]], any(c for _, c in parts)
    raise _Untranslatable(f"expression op {op}")


def _constant(encoded: Any) -> Any:
    return encoded[1] if isinstance(encoded, list) and len(encoded) == 2 else None


def _guard(entry: Any, expr: Any, parse: Any) -> Guard:
    kind, value = entry.guard_type, entry.value
    derived = set(entry.derived_types)
    if kind in ("CONSTANT_MATCH", "EQUALS_MATCH"):
        try:
            return Guard("equals", expr, encode(value))
        except Unencodable:
            if "ID_MATCH" in derived:
                return Guard("named", expr, named(value))
            raise
    if kind == "TYPE_MATCH":
        return Guard("type", expr, qualified_name(type(value)))
    if kind in _NAMED:
        if not (isinstance(value, type) or callable(value) or inspect.ismodule(value)):
            try:
                return Guard("equals", expr, encode(value))
            except Unencodable as exc:
                raise _Untranslatable(f"identity of a {type(value).__name__}") from exc
        return Guard("named", expr, named(value))
    if kind in _LENGTH:
        return Guard("length", expr, [qualified_name(type(value)), len(value)])
    if kind in _KEYS:
        return Guard("keys", expr, dict_keys(value))
    if kind == "EMPTY_NN_MODULE_HOOKS_DICT":
        return Guard("empty", expr, True)
    if kind == "HASATTR":  # the attribute's presence, or its absence, as traced
        return Guard("hasattr", expr, hasattr(value, str(entry.argument)), str(entry.argument))
    if kind == "NOT_PRESENT_IN_GENERIC_DICT":
        return Guard("not_in_dict", expr, True, str(entry.argument))
    if kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS"):
        which = "contains" if kind == "DICT_CONTAINS" else "not_contains"
        return Guard(which, expr, True, encode(entry.argument))
    if kind in ("DUPLICATE_INPUT", "OBJECT_ALIASING") and isinstance(entry.argument, tuple):
        return Guard("is", expr, True, parse(entry.argument[1]))
    if kind == "NOT_NONE":
        return Guard("is_not_none", expr, True)
    raise _Untranslatable(f"a {kind} guard")


def trace_read(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    entries: Sequence[Any],
    traced_code: Any,
    wrapper: Any = None,
) -> TraceRead:
    """The guards of ``model``'s trace as the checks its plan carries (``entries``:
    the adapter's ``GuardEntry`` records), each checked against the traced call.

    ``wrapper``: the function Dynamo ran as the top frame in place of the model's forward
    (``adapter.top_frame_wrapper``: torch.nn's own modules), if any. Its frame's locals
    are then the call's arguments and the model in a closure cell; the forward itself is
    inlined, so its globals are read through the modules Dynamo names by themselves."""
    forward = traced_forward(model)
    state = trace_state()
    name = qualified_name(forward)
    wrapped = wrapper is not None and traced_code is getattr(wrapper, "__code__", None)
    if traced_code is not None and not wrapped and \
            getattr(forward, "__code__", None) is not traced_code:  # fmt: skip
        raise _unsupported(
            f"Dynamo traced {traced_code.co_name} ({traced_code.co_filename}), not the "
            f"model's forward {name}"
        )
    roots = roots_of(model, forward)
    defaults: dict[str, Any] = {}
    if wrapped:
        frame = _wrapper_locals(model, wrapper, args, kwargs)
        closure: Mapping[str, Any] = {}  # the wrapper's cells are not the forward's
    else:
        frame = _frame_locals(model, forward, args, kwargs)
        closure = roots.closure
        defaults = _defaulted(model, forward, args, kwargs)
    guards: dict[str, Guard] = {}
    unchecked: list[str] = []

    def parse(text: str) -> Any:
        rooted, call = _rooted(parse_source(text), model, frame, closure, roots, defaults)
        if call:
            raise _Untranslatable("reads the call's arguments")
        if wrapped:
            _module_globals_only(rooted)
        return rooted

    for entry in entries:
        if entry.guard_type in _COVERED_ELSEWHERE:
            continue
        if entry.guard_type == "AUTOGRAD_SAVED_TENSORS_HOOKS":
            continue  # the global state records them (with grad enabled: see trace_state)
        source = entry.source
        if any(source.startswith(f"G['{prefix}") for prefix in _COMPILER_MODULES):
            continue
        if _INSTALLED_GLOBAL.search(source):
            unchecked.append(
                f"{entry.guard_type} on {_said_source(source)}: reads a global Dynamo "
                "installed under a name made from an object's id in the tracing process "
                "(not portable)"
            )
            continue
        try:
            rooted, reads_call = _rooted(
                parse_source(source), model, frame, closure, roots, defaults
            )
            if reads_call:
                continue  # the call's arguments: the plan's per-call checks
            if wrapped:
                _module_globals_only(rooted)
            guard = _guard(entry, rooted, parse)
            if _history_dependent(guard):
                raise _Untranslatable(
                    "reads a global container by position or by its size, which depend on "
                    "what the process registered there before (not portable)"
                )
            failure = guard.failure(roots)
            if failure is not None:
                raise _Untranslatable(f"does not hold when checked here: {failure}")
        except (_Untranslatable, Unencodable, LookupError, TypeError, AttributeError) as exc:
            unchecked.append(f"{entry.guard_type} on {_said_source(source)}: {exc}")
            continue
        key = repr(guard.to_json())
        guards.setdefault(key, guard)
    if unchecked:
        # Nothing a user can act on (the registries of transformers and torch, read by
        # position): INFO, one line; the list is in the plan and the limits page.
        log.info(
            "compile_model: %d of the trace's guards cannot be checked in another process "
            "(listed in the plan's trace_read.unchecked); the first: %s",
            len(unchecked),
            unchecked[0][:200],
        )
    for guard in _class_forwards(model, roots):
        guards.setdefault(repr(guard.to_json()), guard)
    return TraceRead(tuple(guards.values()), state, name, tuple(unchecked))


def _class_forwards(model: torch.nn.Module, roots: Roots) -> list[Guard]:
    """A guard per module class of the model on its ``forward``, by qualified name and
    code place. Dynamo inlines a submodule's forward and records no guard on it, so a
    class whose forward was replaced (``Sub.forward = other``) before a bind was bound
    and served the traced code; each class is reached through its first submodule (the
    model's own class is not: its forward is checked by name and place at every bind)."""
    found: list[Guard] = []
    seen: set[type] = set()
    for path, module in model.named_modules():
        cls = type(module)
        if not path:  # the model's own forward: its name and place are the read's forward
            seen.add(cls)
        if cls in seen or not inspect.isfunction(getattr(cls, "forward", None)):
            continue
        seen.add(cls)
        expr: Any = ["M"]
        for part in path.split(".") if path else []:
            expr = ["item", ["attr", expr, "_modules"], ["const", encode(part)]]
        guard = Guard("named", ["attr", ["call", "type", [expr]], "forward"], named(cls.forward))
        if guard.failure(roots) is None:
            found.append(guard)
    return found


# Dynamo installs globals for its guards under names made of an object's id and the
# compile's number (``install_global``: ``_140029843829712_c0``): they name nothing in
# another process, and whether one resolves here depends on this process's history.
_INSTALLED_GLOBAL = re.compile(r"G\['_\d+_c\d+")


def _history_dependent(guard: Guard) -> bool:
    """A guard whose answer depends on what a process put into a library's global
    container before (a registry of model classes): its size, its keys, or an entry
    found by position (``list(dict.keys(registry))[1]``). Module attributes, functions
    and everything on the model itself are not."""
    text = repr(guard.expr)
    if "'G'" not in text:
        return False
    # torch's global hooks dicts are keyed by handle ids, which count every hook a process
    # ever registered (a bound compiled model registers its own, see _model_guards)
    by_handle = "_global_" in text and "_hooks'" in text and "'item'" in text
    by_position = "['call', 'list'" in text  # list(dict.keys(registry))[i]
    mutable_size = guard.kind == "keys" or (
        guard.kind == "length" and guard.expected[0] != "builtins.tuple"  # a tuple's is fixed
    )
    return mutable_size or by_position or by_handle


def _said_source(source: str) -> str:
    try:
        return readable(parse_source(source))
    except _Untranslatable:
        return source


def _unsupported(message: str) -> Exception:
    from precompile.runtime import UnsupportedGraphError

    return UnsupportedGraphError(message)
