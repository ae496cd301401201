"""The caller's state, kept while ``compile_model`` runs the model and put back after.

Compiling runs the model: the traced call runs the compiled graph once on the model's
real parameters and buffers and the example's tensors, an example call with an empty
``StaticCache`` is run eagerly once to initialize it, and the check below the traced
range runs it again. A graph that writes its inputs in place (a counter buffer, a KV
cache held in buffers, a parameter, a tensor argument) would leave those writes behind,
and the Python side of a trace may rebind module attributes. ``CallerState`` records
every module's attributes and its parameters, buffers and submodules (by object), and
copies, before a run, the tensors that run may write: for the traced graph exactly the
inputs its manifest says it writes (known once it is compiled, before it runs); for an
eager run, which may write anything, every buffer and tensor argument. ``restore`` puts
the values back in place (``copy_`` under no_grad: the same tensor objects), the module
attributes back, and undoes the autograd history a write under grad mode gave a tensor
that had none. A watched tensor written without a copy (its ``_version`` moved) cannot be
put back: ``check`` refuses the compile then, naming it, rather than leave it changed.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch

from precompile.runtime import UnsupportedGraphError

log = logging.getLogger("precompile.compile")
_TABLES = ("_parameters", "_buffers", "_modules")
Kind = Literal["parameter", "buffer", "argument", "cache"]
_MISSING = object()
# what torch itself sets on a module that ``torch.compile`` traced (not the model's state)
_TORCH_MARKERS = frozenset({"_is_torch_compile"})


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place write counter; None where it has none (inference tensors)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


def _storage(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Which storage the tensor views (None where it has none to compare)."""
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@dataclass
class _Watched:
    """A tensor of the caller's, as it was: how it is named, what it is (a buffer or a
    cache tensor outlives a call: a write under grad would reach the next one), its write
    counter and its autograd state."""

    tensor: torch.Tensor
    name: str
    kind: Kind
    version: int | None
    requires_grad: bool
    had_history: bool


@dataclass
class _Kept:
    """A tensor a run may write, with a copy of its value and layout from before it."""

    tensor: torch.Tensor
    copy: torch.Tensor
    layout: tuple[tuple[int, ...], tuple[int, ...], int]
    version: int | None  # the counter when the copy was right


class CallerState:
    """What compiling ``model`` may change of the caller's, and how it was before (see the
    module docstring). A context manager: leaving it restores, and, where no error is
    already on its way, ``check``s."""

    def __init__(self, model: torch.nn.Module, arguments: Sequence[tuple[str, Any]]) -> None:
        self._modules = [
            (module, dict(vars(module)), {t: dict(getattr(module, t)) for t in _TABLES})
            for module in model.modules()
        ]
        self._watched: dict[int, _Watched] = {}
        for name, tensor in model.named_parameters(remove_duplicate=False):
            self.watch(f"parameter {name!r}", tensor, "parameter")
        for name, tensor in model.named_buffers(remove_duplicate=False):
            self.watch(f"buffer {name!r}", tensor, "buffer")
        for name, tensor in arguments:
            if isinstance(tensor, torch.Tensor):
                self.watch(name, tensor, "argument")
        self._kept: dict[int, _Kept] = {}
        self._unrestorable: list[str] = []
        self._written_with_grad: list[str] = []

    def python_state(self, model: torch.nn.Module) -> list[tuple[str, Any, Any, Any]]:
        """Each module attribute now (by name), and a copy of each list, dict or set
        held in one: what a run that writes Python state would change (``written``)."""
        found = []
        for prefix, module in model.named_modules():
            for key, value in vars(module).items():
                if key in _TABLES or key in _TORCH_MARKERS:
                    continue
                held = copy.copy(value) if type(value) in (list, dict, set) else None
                found.append((f"{prefix}.{key}" if prefix else key, module, value, held))
        return found

    @staticmethod
    def written(before: list[tuple[str, Any, Any, Any]]) -> list[str]:
        """The attributes (of ``python_state``) a run rebound, removed or changed in place."""
        changed = []
        for name, module, value, held in before:
            now = vars(module).get(name.rpartition(".")[2], _MISSING)
            if now is not value or (held is not None and held != now):
                changed.append(f"model.{name}")
        return changed

    @staticmethod
    def put_back(before: list[tuple[str, Any, Any, Any]]) -> None:
        """Put back the contents of the lists, dicts and sets a run changed in place
        (``restore`` puts the attributes themselves back)."""
        for _, _, value, held in before:
            if held is None or held == value:
                continue
            if isinstance(value, list):
                value[:] = held
            else:
                value.clear()
                value.update(held)

    def watch(self, name: str, tensor: torch.Tensor, kind: Kind) -> None:
        """Watch ``tensor`` from now on (a KV cache's tensors, once initialized)."""
        if id(tensor) not in self._watched:
            history = tensor.grad_fn is not None
            self._watched[id(tensor)] = _Watched(
                tensor, name, kind, _version(tensor), tensor.requires_grad, history
            )

    def keep(self, tensors: Iterable[Any]) -> None:
        """Copy these tensors, which the next run may write, unless a copy is kept; and
        the watched tensors that share storage with one (views of one buffer: a write
        through one writes the others, and moves their shared write counter)."""
        wanted = [t for t in tensors if isinstance(t, torch.Tensor)]
        storages = {_storage(t) for t in wanted} - {None}
        wanted += [w.tensor for w in self._watched.values() if _storage(w.tensor) in storages]
        with torch.no_grad():
            for tensor in wanted:
                if id(tensor) in self._kept:
                    continue
                layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
                self._kept[id(tensor)] = _Kept(tensor, tensor.detach().clone(), layout,
                                               _version(tensor))  # fmt: skip

    def keep_all(self) -> None:
        """Before an eager run, which may write any buffer or argument: copy them all
        (parameters stay watched: one written is refused by ``check``)."""
        self.keep(w.tensor for w in self._watched.values() if w.kind != "parameter")

    def restore(self) -> None:
        """Put the module attributes and every kept tensor back as they were."""
        for module, attributes, tables in self._modules:
            current = vars(module)
            for key in [k for k in current if k not in attributes]:
                del current[key]
            for key, value in attributes.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
            for key, saved in tables.items():
                table = attributes[key]  # the dict object of before, restored above
                if table.keys() != saved.keys() or any(table[k] is not v for k, v in saved.items()):
                    table.clear()
                    table.update(saved)
        with torch.no_grad():
            for watched in self._watched.values():
                self._restore_grad_state(watched)
            for kept in self._kept.values():
                tensor = kept.tensor
                layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
                if layout != kept.layout:  # resized in place (a metadata mutation)
                    size, stride, offset = kept.layout
                    tensor.set_(tensor.untyped_storage(), offset, size, stride)
                if kept.version is None or _version(tensor) != kept.version:
                    tensor.copy_(kept.copy)
                    kept.version = _version(tensor)
        for watched in self._watched.values():
            if id(watched.tensor) in self._kept or watched.version is None:
                continue
            moved = _version(watched.tensor) != watched.version
            if moved and watched.name not in self._unrestorable:
                self._unrestorable.append(watched.name)

    def _restore_grad_state(self, watched: _Watched) -> None:
        """A tensor that had no autograd history and was written, under grad mode, with a
        value that requires grad has history now: detached in place, as it was."""
        tensor = watched.tensor
        if watched.had_history or watched.requires_grad or not tensor.requires_grad:
            return
        persistent = watched.kind in ("buffer", "cache")
        if persistent and watched.name not in self._written_with_grad:
            self._written_with_grad.append(watched.name)
        try:
            tensor.detach_()
        except RuntimeError:  # a view of a tensor with history: it cannot be detached
            if watched.name not in self._unrestorable:
                self._unrestorable.append(watched.name)

    def check(self) -> None:
        """Refuse what ``restore`` could not undo, or what a compiled model could not go on
        serving: a buffer or cache the traced call wrote with values that require grad."""
        if self._unrestorable:
            raise UnsupportedGraphError(
                f"compiling ran the model, and it wrote {', '.join(self._unrestorable[:3])} "
                "in place where compile_model kept no copy (outside what the traced graph "
                "says it writes), so it cannot be put back as it was"
            )
        if self._written_with_grad:
            raise UnsupportedGraphError(
                f"the traced call writes {', '.join(self._written_with_grad[:3])} in place "
                "with values that require grad (grad mode is on and the parameters require "
                "grad): after a call it would require grad, which the compiled graph does not "
                "take (it is compiled for the state before the call); compile and call the "
                "model under torch.no_grad()"
            )

    def __enter__(self) -> CallerState:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.restore()
        if kind is None:
            self.check()
        elif self._unrestorable:
            log.warning("could not restore %s after a failed compile", self._unrestorable)
