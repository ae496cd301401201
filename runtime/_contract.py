"""Per-call input contract: what a call's flat inputs must be, checked on every call.

Compiled code indexes its inputs with the sizes and strides it was compiled for, so an
input that differs in any of them (a transposed or sliced view, an ``expand``ed tensor, a
negative- or conjugate-bit view) would give wrong numbers or read out of bounds. The
contract covers, per tensor: type, layout, dtype, device, rank, static sizes, symbol
sizes, strides (of every dim longer than 1), neg/conj bits, ``requires_grad`` against
the grad mode, the value of a float the variants were specialized to, and no aliasing
of an input the graph writes.

Three paths, one contract:
- ``read_key``: strict and fast, generated straight-line code; after the first passing
  call a C++ tensor check (Dynamo's ``TensorGuards``) does the per-tensor work. It says
  None for anything it does not accept as is.
- ``coerce``: the slow path for what ``read_key`` refused. An input that differs only in
  layout is copied into the compiled layout (and, if the graph writes it, copied back
  after the call); anything else raises :class:`InputMismatchError` naming the input,
  what was expected and what came.
- ``trusted_key``: reads the sizes and checks nothing, for callers that already enforce
  all of the above (Dynamo's guards, for an artifact made by ``precompile.backend``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _torch_adapter as adapter
from ._dtypes import device_of, dtype_name, dtype_of
from ._errors import CorruptArtifactError, IndexOutOfRangeError, InputMismatchError
from ._expressions import NAMESPACE, SYMBOL_PREFIX, compile_function, to_python
from ._manifest import IntInput, Manifest, TensorInput

log = logging.getLogger("precompile.runtime")
KeyReader = Callable[[Sequence[Any]], "tuple[int, ...] | None"]
TrustedReader = Callable[[Sequence[Any]], "tuple[int, ...]"]
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _device_test(arg: str, index: int, device: torch.device) -> str:
    """A cheap expression true when tensor ``arg`` is on ``device``.

    ``tensor.device`` builds a new torch.device on every access; the boolean properties
    and ``get_device()`` (an int) answer without that allocation.
    """
    if device.type == "cpu":
        return f"{arg}.is_cpu"
    if device.type == "cuda":
        return f"{arg}.is_cuda and {arg}.get_device() == {device.index or 0}"
    return f"{arg}.device == V{index}"


def _text(entry: int | str, symbols: Sequence[str]) -> str:
    return str(entry) if isinstance(entry, int) else to_python(entry, symbols)


@dataclass
class Prepared:
    """A call's inputs made ready by the slow path: the sizes, the (possibly copied)
    inputs, and the copies to write back into the caller's tensors after the call."""

    key: tuple[int, ...]
    args: list[Any]
    writebacks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class InputContract:
    """What a call's flat inputs must look like, and where each symbol is read from."""

    def __init__(self, manifest: Manifest) -> None:
        self.symbols = manifest.symbol_names
        self.inputs = manifest.inputs
        self.names = tuple(spec.name for spec in manifest.inputs)
        self.training = manifest.training
        self._tensors = {
            i: spec for i, spec in enumerate(self.inputs) if isinstance(spec, TensorInput)
        }
        self._dtypes = {i: dtype_of(spec.dtype) for i, spec in self._tensors.items()}
        self._devices = {i: device_of(spec.device) for i, spec in self._tensors.items()}
        self._mutated = tuple(i for i, s in self._tensors.items() if s.mutation != "none")
        self._steady = [
            i for i, spec in self._tensors.items() if spec.mutation != "none" or spec.static_address
        ]
        self._varying = [i for i in self._tensors if i not in self._steady]
        self._unaliased: tuple[list[int | None], set[int]] | None = None
        names = self.symbols
        # Per tensor: its strides as a function of the symbols' values.
        self._layout = {
            i: compile_function(
                [s if isinstance(s, str) else str(s) for s in spec.strides],
                names,
                name=f"input_{i}_strides",
            )
            for i, spec in self._tensors.items()
        }
        self._first_sources = {s.name: s.sources[0] for s in manifest.symbols}
        self._copy_logged: set[int] = set()
        # Every tensor's requires_grad exactly as traced, whatever the grad mode (see
        # ``require_traced_grad_flags``).
        self.exact_grad = False
        self._checked: KeyReader = self._generate_reader(None)
        self.read_key: KeyReader = self._first_read
        self.trusted_key: TrustedReader = self._generate_trusted_reader()

    def require_traced_grad_flags(self) -> None:
        """Check every tensor's ``requires_grad`` against its value in the trace, under
        ``no_grad`` too: a whole model's Python may branch on it (``if x.requires_grad``),
        and its trace then holds for that value alone (Dynamo guards every tensor's flag).
        A graph handed over as a graph has no such branch, and keeps the looser check."""
        self.exact_grad = True
        self._checked = self._generate_reader(None)
        self.read_key = self._first_read

    # -- fast path -------------------------------------------------------------------
    def _first_read(self, args: Sequence[Any]) -> tuple[int, ...] | None:
        """Check in Python; the first inputs that pass become the template of a C++ guard
        of every tensor's type, dtype, device, dispatch keys, requires_grad, rank, static
        sizes and static strides, which later calls run instead (falling back to the
        Python check whenever the guard says no)."""
        key = self._checked(args)
        if key is None or not self._tensors:
            return key
        if self.training and torch.is_grad_enabled() is False:
            return key  # requires_grad unchecked under no_grad: not a template
        indices = list(self._tensors)
        static_sizes = [
            [size if isinstance(size, int) else None for size in self._tensors[i].shape]
            for i in indices
        ]
        static_strides = [
            [
                stride if isinstance(stride, int) and size != 1 else None
                for size, stride in zip(spec.shape, spec.strides, strict=True)
            ]
            for spec in (self._tensors[i] for i in indices)
        ]  # a dim of size 1 is never stepped along: its stride is not part of the contract
        guard = adapter.tensor_guard([args[i] for i in indices], static_sizes, static_strides)
        if guard is not None:
            grad_sensitive = any(
                args[i].requires_grad and not self._tensors[i].grad_unused for i in indices
            )
            self.read_key = self._generate_reader(guard, grad_sensitive=grad_sensitive)
        else:
            self.read_key = self._checked
        return key

    def _generate_reader(
        self, guard: Callable[..., bool] | None, *, grad_sensitive: bool = False
    ) -> KeyReader:
        symbols = self.symbols
        lines = ["def read_key(args):", "    try:", f"        if len(args) != {len(self.inputs)}:"]
        lines.append("            return None")
        namespace: dict[str, Any] = {
            **NAMESPACE,
            "__builtins__": {
                "len": len,
                "type": type,
                "int": int,
                "AttributeError": AttributeError,
                "TypeError": TypeError,
                "IndexError": IndexError,
                "RuntimeError": RuntimeError,
            },
            "T": torch.Tensor,
            "P": torch.nn.Parameter,
            "GRAD": torch.is_grad_enabled,
        }
        if guard is not None:
            tensors = ", ".join(f"args[{i}]" for i in self._tensors)
            lines.append(f"        if not GUARD({tensors}):")
            lines.append("            return CHECKED(args)")
            namespace["GUARD"], namespace["CHECKED"] = guard, self._checked
            if grad_sensitive and not self.training:
                # The template had inputs requiring grad: fine under no_grad only.
                lines.append("        if GRAD():")
                lines.append("            return CHECKED(args)")
        elif self._tensors:
            lines.append("        grad = GRAD()")
        assigned: set[str] = set()
        deferred: list[str] = []

        def bind(symbol: str, value_expr: str) -> None:
            target = SYMBOL_PREFIX + symbol
            if symbol in assigned:
                lines.append(f"        if {value_expr} != {target}:")
                lines.append("            return None")
            else:
                lines.append(f"        {target} = {value_expr}")
                assigned.add(symbol)

        for index, spec in enumerate(self.inputs):
            arg = f"a{index}"
            if isinstance(spec, IntInput):
                lines.append(f"        {arg} = args[{index}]")
                lines.append(f"        if type({arg}) is not int:")
                lines.append("            return None")
                if isinstance(spec.value, int):
                    lines.append(f"        if {arg} != {spec.value}:")
                    lines.append("            return None")
                elif spec.value in symbols:
                    bind(spec.value, arg)
                else:
                    deferred.append(f"{arg} != {to_python(spec.value, symbols)}")
                continue
            static_shape = all(isinstance(size, int) for size in spec.shape)
            # the strides of dims that can be longer than 1 (a dim of size 1 is never
            # stepped along: its stride is not part of the contract, as in coerce)
            stepped = [dim for dim, size in enumerate(spec.shape) if size != 1]
            static_stride = all(isinstance(spec.strides[dim], int) for dim in stepped)
            offset = spec.storage_offset if spec.aliased else None
            needs_python = spec.value is not None or offset is not None
            if guard is not None and static_shape and static_stride and not needs_python:
                continue  # everything about it is checked by the C++ guard
            lines.append(f"        {arg} = args[{index}]")
            if guard is None:
                namespace[f"D{index}"] = self._dtypes[index]
                namespace[f"V{index}"] = self._devices[index]
                on_device = _device_test(arg, index, self._devices[index])
                lines.append(f"        if type({arg}) is not T and type({arg}) is not P:")
                lines.append("            return None")
                lines.append(f"        if {arg}.dtype is not D{index} or not ({on_device}):")
                lines.append("            return None")
                lines.append(f"        if {arg}.is_neg() or {arg}.is_conj():")
                lines.append("            return None")
                if self.exact_grad:
                    lines.append(f"        if {arg}.requires_grad is not {spec.requires_grad}:")
                    lines.append("            return None")
                elif self.training:
                    lines.append(
                        f"        if grad and {arg}.requires_grad is not {spec.requires_grad}:"
                    )
                    lines.append("            return None")
                if not self.training and not spec.grad_unused:
                    lines.append(f"        if grad and {arg}.requires_grad:")
                    lines.append("            return None")
            if static_shape:
                if guard is None:
                    namespace[f"S{index}"] = tuple(spec.shape)
                    lines.append(f"        if {arg}.shape != S{index}:")
                    lines.append("            return None")
            else:
                lines.append(f"        sh = {arg}.shape")
                if guard is None:
                    lines.append(f"        if len(sh) != {len(spec.shape)}:")
                    lines.append("            return None")
                for dim, size in enumerate(spec.shape):
                    if isinstance(size, int):
                        if guard is None:
                            lines.append(f"        if sh[{dim}] != {size}:")
                            lines.append("            return None")
                    elif size in symbols:
                        bind(size, f"sh[{dim}]")
                    else:
                        deferred.append(f"sh{index}_{dim} != {to_python(size, symbols)}")
                        lines.append(f"        sh{index}_{dim} = sh[{dim}]")
            if stepped and not (static_stride and guard is not None):
                strides = ", ".join(_text(spec.strides[dim], symbols) for dim in stepped)
                actual = ", ".join(f"st{index}[{dim}]" for dim in stepped)
                comma = "," if len(stepped) == 1 else ""
                lines.append(f"        st{index} = {arg}.stride()")
                deferred.append(f"({actual}{comma}) != ({strides}{comma})")
            if offset is not None:
                lines.append(f"        if {arg}.storage_offset() != {offset}:")
                lines.append("            return None")
            if spec.value is not None:
                namespace[f"F{index}"] = spec.value
                if math.isnan(spec.value):
                    lines.append(f"        if {arg}.item() == {arg}.item():")
                else:
                    lines.append(f"        if {arg}.item() != F{index}:")
                lines.append("            return None")
        missing = [s for s in symbols if s not in assigned]
        if missing:
            raise CorruptArtifactError(f"symbols {missing} are not read from any input")
        for condition in deferred:
            lines.append(f"        if {condition}:")
            lines.append("            return None")
        if self._mutated:
            namespace["ALIASED"] = self._aliased_unless_seen
            lines.append("        if ALIASED(args):")
            lines.append("            return None")
        lines.append(f"        return {self._key_tuple()}")
        lines.append("    except (AttributeError, TypeError, IndexError, RuntimeError):")
        lines.append("        return None")
        source = "\n".join(lines) + "\n"
        exec(compile(source, "<precompile input contract>", "exec"), namespace)
        reader: KeyReader = namespace["read_key"]
        reader.source = source  # type: ignore[attr-defined]  # for explain-the-check debugging
        return reader

    def _key_tuple(self) -> str:
        names = [SYMBOL_PREFIX + s for s in self.symbols]
        return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"

    def _generate_trusted_reader(self) -> TrustedReader:
        """Only reads each symbol from its first source: the caller enforces the rest."""
        reads = []
        for symbol in self.symbols:
            source = self._first_sources[symbol]
            index, dim = source.input_index, source.dim
            reads.append(f"args[{index}]" if dim is None else f"args[{index}].shape[{dim}]")
        body = "(" + ", ".join(reads) + ("," if len(reads) == 1 else "") + ")"
        namespace: dict[str, Any] = {"__builtins__": {}}
        exec(
            compile(f"def trusted_key(args):\n    return {body}\n", "<precompile trusted>", "exec"),
            namespace,
        )
        reader: TrustedReader = namespace["trusted_key"]
        return reader

    def _aliased_unless_seen(self, args: Sequence[Any]) -> bool:
        """``_mutated_input_aliased`` for the fast path. The written inputs and the inputs
        whose address is static (weights, a KV cache) usually keep their data pointers
        from call to call: where they all have the ones of the last call found unaliased
        (one C++ compare), only the other inputs (a decode step's new token ids) are
        checked against the written inputs' storages. Memory can only overlap where
        addresses do, and sizes and strides are checked apart."""
        seen = self._unaliased
        if seen is not None and adapter.data_ptrs_equal(list(args), seen[0], self._steady):
            storages = seen[1]
            for i in self._varying:
                tensor = args[i]
                if tensor.numel() and tensor.untyped_storage().data_ptr() in storages:
                    return True
            return False
        if self._mutated_input_aliased(args) is not None:
            return True
        ptrs: list[int | None] = [None] * len(args)
        for i in self._steady:
            ptrs[i] = args[i].data_ptr()
        written = {args[i].untyped_storage().data_ptr() for i in self._mutated if args[i].numel()}
        self._unaliased = (ptrs, written)
        return False

    def _mutated_input_aliased(self, args: Sequence[Any]) -> tuple[int, int] | None:
        """An input the graph writes and another tensor input sharing its memory (compiled
        code reads the other as it was before the write), as their indices; None where
        none does."""
        written: dict[int, int] = {}  # storage address -> the written input there
        for i in self._mutated:
            tensor = args[i]
            if tensor.numel():
                address = tensor.untyped_storage().data_ptr()
                if address in written:
                    return written[address], i
                written[address] = i
        for i in self._tensors:
            if i not in self._mutated and args[i].numel():
                found = written.get(args[i].untyped_storage().data_ptr())
                if found is not None:
                    return found, i
        return None

    # -- slow path -------------------------------------------------------------------
    def coerce(self, args: Sequence[Any], *, copy: bool = True) -> Prepared:
        """Accept ``args`` (copying inputs whose layout differs into the compiled layout)
        or raise :class:`InputMismatchError` saying which input is wrong and how, by
        index and by name. ``copy=False`` only checks (for ``explain``): the returned
        args are the given ones."""
        try:
            return self._coerce(args, copy)
        except InputMismatchError as exc:
            raise exc.restated(name_inputs(str(exc), self.names)) from None

    def _label(self, index: int) -> str:
        return input_label(index, self.names)

    def _coerce(self, args: Sequence[Any], copy: bool) -> Prepared:
        if len(args) != len(self.inputs):
            listed = ", ".join(f"{i}: {name or '?'}" for i, name in enumerate(self.names[:40])) + (
                ", ..." if len(self.names) > 40 else ""
            )
            raise InputMismatchError(
                f"expected {len(self.inputs)} flat inputs (the graph's placeholders, "
                f"SymInt placeholders as ints), got {len(args)}; the inputs are {listed}",
                expected=len(self.inputs),
                got=len(args),
            )
        values: dict[str, tuple[int, str]] = {}
        deferred: list[tuple[str, int, str, int]] = []

        def record(name: str, value: int, where: str, index: int) -> None:
            if name in values and values[name][0] != value:
                first, origin = values[name]
                raise InputMismatchError(
                    f"symbol {name} is {first} from {origin} but {value} from {where}; "
                    "the graph needs them equal",
                    input_name=self._label(index),
                    expected=first,
                    got=value,
                )
            values.setdefault(name, (value, where))

        for index, (spec, arg) in enumerate(zip(self.inputs, args, strict=True)):
            if isinstance(spec, IntInput):
                if type(arg) is not int:
                    raise InputMismatchError(
                        f"input {index} should be an int (a SymInt placeholder), "
                        f"got {type(arg).__name__}",
                        input_name=self._label(index),
                        expected="int",
                        got=type(arg).__name__,
                    )
                if isinstance(spec.value, int):
                    if arg != spec.value:
                        raise InputMismatchError(
                            f"input {index} should be {spec.value}, got {arg}",
                            input_name=self._label(index),
                            expected=spec.value,
                            got=arg,
                        )
                elif spec.value in self.symbols:
                    record(spec.value, arg, f"input {index}", index)
                else:
                    deferred.append((spec.value, arg, f"input {index}", index))
                continue
            self._check_tensor_kind(index, spec, arg)
            for dim, size in enumerate(spec.shape):
                actual = int(arg.shape[dim])
                if isinstance(size, int):
                    if actual != size:
                        raise InputMismatchError(
                            f"input {index} dim {dim} is static and must be {size} "
                            f"(shape {_shape_text(spec.shape)}), got shape {tuple(arg.shape)}",
                            input_name=self._label(index),
                            expected=tuple(spec.shape),
                            got=tuple(arg.shape),
                        )
                elif size in self.symbols:
                    record(size, actual, f"input {index} dim {dim}", index)
                else:
                    deferred.append((size, actual, f"input {index} dim {dim}", index))
        key = tuple(values[name][0] for name in self.symbols)
        for expression, actual, where, index in deferred:
            expected = compile_function([expression], self.symbols)(*key)[0]
            if actual != expected:
                raise InputMismatchError(
                    f"{where} must equal {expression} = {expected}, got {actual}",
                    input_name=self._label(index),
                    expected=expected,
                    got=actual,
                )
        prepared = Prepared(key, list(args))
        grad = torch.is_grad_enabled()
        for index, spec in self._tensors.items():
            self._check_tensor_state(index, spec, args[index], grad)
            self._fit_layout(index, spec, prepared, copy)
        aliased = self._mutated_input_aliased(prepared.args) if self._mutated else None
        if aliased is not None:
            written, other = (self._label(i) for i in aliased)
            raise InputMismatchError(
                f"{written} is written by the graph and shares memory with {other}; "
                "compiled code would read the other as it was before the write: pass "
                "separate tensors",
                input_name=written,
            )
        return prepared

    def _check_tensor_kind(self, index: int, spec: TensorInput, arg: Any) -> None:
        if not isinstance(arg, torch.Tensor):
            raise InputMismatchError(
                f"input {index} should be a {spec.dtype} tensor on {spec.device}, "
                f"got {type(arg).__name__}",
                input_name=self._label(index),
                expected="Tensor",
                got=type(arg).__name__,
            )
        if type(arg) not in _PLAIN_TYPES:
            raise InputMismatchError(
                f"input {index} is a {type(arg).__name__} (a tensor subclass); the variants "
                "were compiled for plain tensors",
                input_name=self._label(index),
                expected="Tensor",
                got=type(arg).__name__,
            )
        if arg.layout is not torch.strided:
            raise InputMismatchError(
                f"input {index} has layout {arg.layout}; the variants were compiled for "
                "torch.strided (dense) tensors",
                input_name=self._label(index),
                expected=str(torch.strided),
                got=str(arg.layout),
            )
        if arg.dtype is not self._dtypes[index]:
            raise InputMismatchError(
                f"input {index} should have dtype {spec.dtype}, got {dtype_name(arg.dtype)}",
                input_name=self._label(index),
                expected=spec.dtype,
                got=dtype_name(arg.dtype),
            )
        if arg.device != self._devices[index]:
            raise InputMismatchError(
                f"input {index} should be on device {spec.device}, got {arg.device}",
                input_name=self._label(index),
                expected=spec.device,
                got=str(arg.device),
            )
        if arg.dim() != len(spec.shape):
            raise InputMismatchError(
                f"input {index} should have rank {len(spec.shape)} with shape "
                f"{_shape_text(spec.shape)}, got shape {tuple(arg.shape)}",
                input_name=self._label(index),
                expected=tuple(spec.shape),
                got=tuple(arg.shape),
            )

    def _check_tensor_state(
        self, index: int, spec: TensorInput, arg: torch.Tensor, grad: bool
    ) -> None:
        if spec.value is not None:
            actual = arg.item()
            same = actual == spec.value or (math.isnan(actual) and math.isnan(spec.value))
            if not same:
                raise InputMismatchError(
                    f"input {index} is a float the variants were specialized to ({spec.value!r}), "
                    f"got {actual!r}; compile again for another value",
                    input_name=self._label(index),
                    expected=spec.value,
                    got=actual,
                )
        if self.exact_grad and arg.requires_grad != spec.requires_grad:
            name = f"input {index}" + (f" ({spec.name})" if spec.name else "")
            raise InputMismatchError(
                f"{name} has requires_grad={arg.requires_grad}, but the model was traced with "
                f"requires_grad={spec.requires_grad}: its forward may read the flag (Dynamo "
                "guards it), so the compiled model holds for that value alone; set it back "
                "(requires_grad_()) or compile the model as it is now",
                input_name=self._label(index),
                expected=spec.requires_grad,
                got=arg.requires_grad,
            )
        if not grad:
            return
        if not self.training and arg.requires_grad and not spec.grad_unused:
            raise InputMismatchError(
                f"input {index} requires grad, but the variants were compiled for inference "
                "(no backward graph), so the output would not be connected to autograd; call "
                "under torch.no_grad() or torch.inference_mode(), or compile with grad enabled",
                input_name=self._label(index),
                expected=False,
                got=True,
            )
        if self.training and arg.requires_grad != spec.requires_grad:
            raise InputMismatchError(
                f"input {index} has requires_grad={arg.requires_grad}, but the backward graph "
                f"was compiled for requires_grad={spec.requires_grad}",
                input_name=self._label(index),
                expected=spec.requires_grad,
                got=arg.requires_grad,
            )

    def _fit_layout(self, index: int, spec: TensorInput, prepared: Prepared, copy: bool) -> None:
        arg: torch.Tensor = prepared.args[index]
        expected = tuple(int(v) for v in self._layout[index](*prepared.key))
        actual = arg.stride()
        differs = [
            dim for dim, size in enumerate(arg.shape) if size > 1 and actual[dim] != expected[dim]
        ]
        flags = [name for name, on in (("neg", arg.is_neg()), ("conj", arg.is_conj())) if on]
        offset = spec.storage_offset
        if spec.aliased and offset is not None and arg.storage_offset() != offset:
            raise InputMismatchError(
                f"input {index} has storage offset {arg.storage_offset()}, but an output is "
                f"a view of it compiled for offset {spec.storage_offset}; pass a tensor "
                f"with that offset",
                input_name=self._label(index),
                expected=spec.storage_offset,
                got=arg.storage_offset(),
            )
        if not differs and not flags:
            return
        what = (
            f"strides {tuple(actual)} where the variants were compiled for {expected}"
            if differs
            else f"the {'/'.join(flags)} bit set"
        )
        if spec.aliased or spec.mutation == "metadata":
            reason = (
                "an output is a view of it" if spec.aliased else "the graph resizes it in place"
            )
            raise InputMismatchError(
                f"input {index} has {what}; it cannot be copied into the compiled layout "
                f"because {reason}: pass it with strides {expected} and no neg/conj bit",
                input_name=self._label(index),
                expected=expected,
                got=tuple(actual),
            )
        if spec.mutation == "data":
            if may_overlap(arg.shape, arg.stride()):
                raise InputMismatchError(
                    f"input {index} has {what}, and its elements overlap in memory (an expand()ed "
                    "tensor), but the graph writes it: pass a tensor that owns its elements",
                    input_name=self._label(index),
                    expected=expected,
                    got=tuple(actual),
                )
            if arg.requires_grad and torch.is_grad_enabled():
                raise InputMismatchError(
                    f"input {index} has {what}, requires grad and is written by the graph; "
                    f"pass it with strides {expected}",
                    input_name=self._label(index),
                    expected=expected,
                    got=tuple(actual),
                )
        if differs and may_overlap(arg.shape, expected):
            raise InputMismatchError(
                f"input {index} has {what}: the variants were compiled for a layout whose "
                f"elements overlap in memory (an expand()ed example), which holds one value "
                "where this input may hold several; compile with an example that owns its "
                "elements (.contiguous()), or pass this input expanded alike",
                input_name=self._label(index),
                expected=expected,
                got=tuple(actual),
            )
        if not copy:
            return
        # copy_ resolves neg/conj bits and, with grad enabled, stays differentiable.
        fitted = torch.empty_strided(tuple(arg.shape), expected, dtype=arg.dtype, device=arg.device)
        fitted.copy_(arg)
        prepared.args[index] = fitted
        if spec.mutation == "data":
            prepared.writebacks.append((arg, fitted))
        if index not in self._copy_logged:
            self._copy_logged.add(index)
            log.debug("input %d has %s: copied into the compiled layout for this call", index, what)


def may_overlap(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a tensor of this shape and stride may share memory (an
    ``expand``ed tensor does). Dims sorted by stride must each step past everything the
    smaller ones span; a layout that does not is treated as overlapping. An empty tensor
    has no elements to share (its layout expressions may give stride 0)."""
    if 0 in shape:
        return False
    span = 0
    for size, step in sorted(
        ((size, abs(step)) for size, step in zip(shape, stride, strict=True) if size > 1),
        key=lambda pair: pair[1],
    ):
        if step <= span:
            return True
        span += (size - 1) * step
    return False


def _shape_text(shape: Sequence[int | str]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def index_checks(manifest: Manifest) -> tuple[tuple[int, int], ...]:
    """(input, rows) per CPU input whose values index a table of that many rows. A CUDA
    input is not checked: that would wait for the GPU at every call, and eager's own
    out-of-range read there is a device-side assert too."""
    return tuple(
        (index, spec.index_rows)
        for index, spec in enumerate(manifest.inputs)
        if isinstance(spec, TensorInput)
        and spec.index_rows is not None
        and device_of(spec.device).type == "cpu"
    )


def check_indices(args: Sequence[Any], checks: Sequence[tuple[int, int]]) -> None:
    """Refuse a call whose index inputs hold a value outside their table, before a
    compiled kernel reads past it (or ends the process in its own bounds check, which
    it makes inside an OpenMP region)."""
    for index, rows in checks:
        indices = args[index]
        if not isinstance(indices, torch.Tensor) or indices.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(indices))
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise IndexOutOfRangeError(
                f"input {index} holds {bad}, outside the embedding's {rows} rows (its values "
                f"must lie in [0, {rows}))",
                input_name=f"input {index}",
                expected=range(rows),
                got=bad,
            )


_KERNEL_CHECK = re.compile(r"index out of bounds: ([^\n]*)")


def kernel_index_failure(message: str) -> str | None:
    """What to say of a compiled C++ kernel's failed index check (the ``RuntimeError`` a
    kernel raises, see ``precompile._kernel_checks``), or None for another error."""
    found = _KERNEL_CHECK.search(message)
    if found is None:
        return None
    return (
        "an index made from this call's inputs lies outside the tensor it indexes (a compiled "
        f"kernel's check `{found.group(1).strip()}` failed, where eager raises IndexError): "
        "check the inputs' values (token or position ids, cache positions) and their sizes "
        "against each other (an attention mask's rows against input_ids'); a graph that "
        "writes an input (a KV cache) may have written part of it"
    )


_INPUT_INDEX = re.compile(r"\binput (\d+)\b(?! \()")


def input_label(index: int, names: Sequence[str | None]) -> str:
    """How a refusal's ``input_name`` says graph input ``index``: its name in the
    manifest, else ``input N``."""
    name = names[index] if index < len(names) else None
    return name or f"input {index}"


def label_index(label: str | None, names: Sequence[str | None]) -> int | None:
    """The graph input an ``input_label`` says (None: none, or not one of these)."""
    if label is None:
        return None
    if label in names:
        return names.index(label)
    found = re.fullmatch(r"input (\d+)", label)
    return int(found.group(1)) if found else None


def name_inputs(message: str, names: Sequence[str | None]) -> str:
    """``message`` with each ``input N`` it says followed by that input's name, where the
    manifest has one (and the message does not name it already)."""

    def named(match: re.Match[str]) -> str:
        index = int(match.group(1))
        name = names[index] if index < len(names) else None
        return f"{match.group(0)} ({name})" if name else match.group(0)

    return _INPUT_INDEX.sub(named, message)
