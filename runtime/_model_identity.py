"""What a compiled model was compiled from, computed from the model object alone (no
tracing, a few milliseconds): its class, the sources of its modules' classes, its
config and every submodule's settings, and its parameters' and buffers' names, shapes,
dtypes and devices.

These are the factors of ``compile_model``'s cache key that describe the model (the
rest describe the call, the options and the environment). A compiled plan records
them, so a load binds it only to a model they still describe: the same class with
another layer count, ``rms_norm_eps`` or activation runs other code than was compiled.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

from precompile.cache import sha256_hex

from ._dtypes import dtype_name
from ._errors import IncompatibleArtifactError
from ._model_guards import Unencodable, encode, named

# Each factor, and what differs where it does (for the error a load raises).
FACTORS = {
    "model_class": "its class",
    "model_sources": "the source files of its modules' classes",
    "model_settings": "its config or a submodule's settings",
    "model_tensors": "its parameters' or buffers' names, shapes, dtypes or devices",
}


# What a bind compares of the recorded factors: the class, and the tensors (checked per
# call too; here an early, whole-model refusal).
BIND_FACTORS = ("model_class", "model_tensors")


def class_path(model: Any) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return sha256_hex(handle.read())
    except OSError:
        return None


def canonical_digest(value: Any) -> str:
    """sha256 of a JSON value's canonical text (anything else by its ``repr``)."""
    text = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _constant(value: Any) -> Any:
    """A code constant as the digest holds it: nested code by its digest, a frozenset
    (``x in {"a", "b"}``) sorted, since its order follows the process's string hashes."""
    if isinstance(value, types.CodeType):
        return code_digest(value)
    if isinstance(value, frozenset):
        return ["frozenset", sorted(repr(_constant(v)) for v in value)]
    if isinstance(value, tuple):
        return [_constant(v) for v in value]
    return repr(value)


def code_digest(code: types.CodeType) -> str:
    """sha256 of what a code object runs: its bytecode, constants (nested code by its own
    digest), names and signature; not its file name or line numbers, so the same
    function typed again (a notebook cell run again) has the same digest."""
    consts = [_constant(c) for c in code.co_consts]
    parts = [code.co_code.hex(), consts, code.co_names, code.co_varnames, code.co_freevars,
             code.co_cellvars, code.co_argcount, code.co_kwonlyargcount, code.co_flags]  # fmt: skip
    return canonical_digest(parts)


def _wrapped_chain(value: Any) -> list[types.CodeType]:
    """The code of a function and of each function it wraps (``functools.wraps``,
    ``lru_cache``: the wrapper's code is the same whatever it wraps), read from
    ``__dict__`` alone (no attribute lookup that could run code)."""
    codes = []
    for _ in range(8):
        if isinstance(value, types.FunctionType):
            codes.append(value.__code__)
        inner = getattr(value, "__dict__", {}).get("__wrapped__")
        if inner is None:
            break
        value = inner
    return codes


def _functions(cls: type) -> list[tuple[str, types.CodeType]]:
    """The code of each function a class defines (methods, static and class methods,
    properties' accessors, and what their decorators wrap), by name."""
    found: list[tuple[str, types.CodeType]] = []
    for name, value in sorted(vars(cls).items()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        accessors = [value.fget, value.fset] if isinstance(value, property) else [value]
        for function in accessors:
            found.extend((name, code) for code in _wrapped_chain(function))
    return found


def _file_of(module: Any) -> Any:
    """A module's ``__file__`` from its ``__dict__`` (a module's ``__getattr__``, as
    ``torch.ops`` has, is not asked)."""
    return getattr(module, "__dict__", {}).get("__file__")


def fileless_classes(model: torch.nn.Module) -> list[type]:
    """The classes of the model's modules (and their bases) defined where no source file
    is: ``python -c``, a notebook cell, ``exec``."""
    found: dict[type, None] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__ == "builtins":
                continue
            if not _file_of(sys.modules.get(cls.__module__)):
                found.setdefault(cls)
    return list(found)


def _defined_in(value: Any) -> Any:
    """The module a function (or a wrapper object ``functools`` made) was defined in."""
    if isinstance(value, types.FunctionType):
        return value.__module__
    namespace = getattr(value, "__dict__", None)
    if isinstance(namespace, dict) and "__wrapped__" in namespace:
        return namespace.get("__module__")
    return None


NO_FILE = "<no file: "  # how a traced file's place names code defined where no file is


def fileless_functions() -> dict[str, types.CodeType]:
    """The code of every function defined where no source file is (``python -c``, a
    notebook, a module made by ``exec``: no ``__file__``, no import spec), by
    ``module.qualname[.function]``: module-level functions, the functions of classes
    defined there, and what their decorators wrap (``.__wrapped__``)."""
    found: dict[str, types.CodeType] = {}
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or module_name == "builtins":
            continue
        if namespace.get("__file__") or namespace.get("__spec__") is not None:
            continue  # a file, or an import system's module (C extensions, packages)
        for name, value in list(namespace.items()):
            if isinstance(value, type) and value.__module__ == module_name:
                for function, code in _functions(value):
                    found.setdefault(f"{module_name}.{value.__qualname__}.{function}", code)
            elif _defined_in(value) == module_name:
                for depth, code in enumerate(_wrapped_chain(value)):
                    found[f"{module_name}.{name}" + ".__wrapped__" * depth] = code
    return found


def module_sources(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of the source file of every module class in the model (and the model's);
    a class defined where no file is (``python -c``, a notebook), by its functions' code."""
    found: dict[str, str] = {}
    for module in model.modules():
        name = type(module).__module__
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and path not in found:
            found[path] = file_digest(path) or "unreadable"
    for cls in fileless_classes(model):
        codes = [[name, code_digest(code)] for name, code in _functions(cls)]
        found[f"{NO_FILE}{cls.__module__}.{cls.__qualname__}>"] = canonical_digest(codes)
    return dict(sorted(found.items()))


def _setting(value: Any) -> Any:
    """A submodule attribute as the key holds it (plain values, tuples and lists of them,
    dtypes, devices, enums; functions and classes by qualified name), or ``_SKIP``."""
    try:
        return encode(value)
    except Unencodable:
        pass
    if isinstance(value, type) or (callable(value) and not isinstance(value, torch.nn.Module)):
        try:
            return named(value)
        except Unencodable:
            return _SKIP
    return _SKIP


_SKIP = object()


def settings(model: torch.nn.Module) -> list[Any]:
    """What configures each submodule beyond its weights: ``extra_repr`` (eps, sizes, ...)
    and its public attributes that have a value across processes (``_setting``), the
    process groups it holds (by name), and the model's config. A routing key only: a
    load checks what the trace read (``precompile.runtime._model_guards``)."""
    found: list[Any] = []
    groups = _process_group_type()
    for name, module in model.named_modules():
        plain = {}
        for key, value in vars(module).items():
            if key.startswith("_"):
                continue
            if groups is not None and isinstance(value, groups):
                # the group a module's collectives run over (a traced collective names it)
                plain[key] = f"process group {getattr(value, 'group_name', value)}"
            elif (setting := _setting(value)) is not _SKIP:
                plain[key] = setting
        found.append([name, type(module).__qualname__, module.extra_repr(), plain])
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    found.append(["config", to_json(use_diff=False) if callable(to_json) else repr(config)])
    return found


def _process_group_type() -> type | None:
    """torch.distributed's ProcessGroup, where this build of torch has one."""
    import torch.distributed as dist

    return dist.ProcessGroup if dist.is_available() else None


def tensors(model: torch.nn.Module) -> list[Any]:
    rows = []
    for kind, items in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in items:
            rows.append(
                [kind, name, list(tensor.shape), dtype_name(tensor.dtype), str(tensor.device),
                 bool(tensor.requires_grad)]
            )  # fmt: skip
    return rows


def model_identity(model: torch.nn.Module) -> dict[str, str]:
    """The key factors that describe ``model`` itself, by the names in ``FACTORS``."""
    return {
        "model_class": class_path(model),
        "model_sources": canonical_digest(module_sources(model)),
        "model_settings": canonical_digest(settings(model)),
        "model_tensors": canonical_digest(tensors(model)),
    }


def check_identity(recorded: Mapping[str, str], model: torch.nn.Module, where: str) -> None:
    """Refuse to bind a plan to a model its recorded factors do not describe (a plan
    that recorded none cannot be checked, and is refused too)."""
    if not recorded:
        raise IncompatibleArtifactError(
            f"{where} records no model to check this one against; compile it again"
        )
    current = model_identity(model)
    if recorded.get("model_class") != current["model_class"]:
        raise IncompatibleArtifactError(
            f"{where} is for {recorded.get('model_class')}, this model is {class_path(model)}"
        )
    # the rest of what the model's code read is checked by the trace's own guards
    # (``precompile.runtime._model_guards``); its sources by the traced files' digests
    differing = [name for name in BIND_FACTORS if recorded.get(name) != current[name]]
    if differing:
        what = "; ".join(f"{name}: {FACTORS[name]}" for name in differing)
        raise IncompatibleArtifactError(
            f"{where} was compiled from another model: this one differs in "
            f"{', '.join(differing)} ({what}); load it with the model it was compiled from, "
            "or compile this one"
        )
