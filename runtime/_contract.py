"""Per-call input contract: validate the flat inputs and read the symbols' values.

The check runs on every call, so it is generated once per artifact as straight-line
Python (no loops, no dict lookups); the slow, descriptive path only runs when the fast
one rejects the inputs, to say exactly which input is wrong and what was expected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _torch_adapter as adapter
from ._errors import CorruptArtifactError, InputMismatchError
from ._expressions import check_expression, compile_function
from ._manifest import IntInput, Manifest, TensorInput

KeyReader = Callable[[Sequence[Any]], "tuple[int, ...] | None"]


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CorruptArtifactError(f"manifest names unknown dtype {name!r}")
    return value


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        raise CorruptArtifactError(f"manifest names unknown device {name!r}") from None


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


class InputContract:
    """What a call's flat inputs must look like, and where each symbol is read from."""

    def __init__(self, manifest: Manifest) -> None:
        self.symbols = manifest.symbol_names
        self.inputs = manifest.inputs
        self._dtypes = {
            i: _dtype(spec.dtype)
            for i, spec in enumerate(self.inputs)
            if isinstance(spec, TensorInput)
        }
        self._devices = {
            i: _device(spec.device)
            for i, spec in enumerate(self.inputs)
            if isinstance(spec, TensorInput)
        }
        self._tensor_indices = [
            i for i, spec in enumerate(self.inputs) if isinstance(spec, TensorInput)
        ]
        self._checked: KeyReader = self._generate_reader(None)
        self.read_key: KeyReader = self._first_read

    # -- fast path -------------------------------------------------------------------
    def _first_read(self, args: Sequence[Any]) -> tuple[int, ...] | None:
        """Check in Python; the first inputs that pass become the template of a C++ guard
        of every tensor's dtype, device, rank and static sizes, which later calls run
        instead (falling back to the Python check whenever the guard says no)."""
        key = self._checked(args)
        if key is None or not self._tensor_indices:
            return key
        static = [
            [size if isinstance(size, int) else None for size in spec.shape]
            for spec in self.inputs
            if isinstance(spec, TensorInput)
        ]
        guard = adapter.tensor_guard([args[i] for i in self._tensor_indices], static)
        if guard is not None:
            self.read_key = self._generate_reader(guard)
        else:
            self.read_key = self._checked
        return key

    def _generate_reader(self, guard: Callable[..., bool] | None) -> KeyReader:
        lines = ["def read_key(args):", "    try:", f"        if len(args) != {len(self.inputs)}:"]
        lines.append("            return None")
        if guard is not None:
            tensors = ", ".join(f"args[{i}]" for i in self._tensor_indices)
            lines.append(f"        if not GUARD({tensors}):")
            lines.append("            return CHECKED(args)")
        assigned: set[str] = set()
        deferred: list[str] = []
        namespace: dict[str, Any] = {
            "__builtins__": {
                "len": len,
                "type": type,
                "int": int,
                "AttributeError": AttributeError,
                "TypeError": TypeError,
                "IndexError": IndexError,
            }
        }

        def bind(target: str, value_expr: str) -> None:
            if target in assigned:
                lines.append(f"        if {value_expr} != {target}:")
                lines.append("            return None")
            else:
                lines.append(f"        {target} = {value_expr}")
                assigned.add(target)

        for index, spec in enumerate(self.inputs):
            arg = f"a{index}"
            fully_guarded = isinstance(spec, TensorInput) and all(
                isinstance(size, int) for size in spec.shape
            )
            if guard is not None and fully_guarded:
                continue  # dtype, device, rank and sizes: all checked by the guard
            lines.append(f"        {arg} = args[{index}]")
            if isinstance(spec, IntInput):
                lines.append(f"        if type({arg}) is not int:")
                lines.append("            return None")
                if isinstance(spec.value, int):
                    lines.append(f"        if {arg} != {spec.value}:")
                    lines.append("            return None")
                elif spec.value in self.symbols:
                    bind(spec.value, arg)
                else:
                    deferred.append(f"{arg} != ({spec.value})")
                continue
            if guard is not None:  # dtype, device, rank and static sizes: checked in C++
                for dim, size in enumerate(spec.shape):
                    if isinstance(size, str):
                        expr = f"{arg}.shape[{dim}]"
                        if size in self.symbols:
                            bind(size, expr)
                        else:
                            lines.append(f"        d{index}_{dim} = {expr}")
                            deferred.append(f"d{index}_{dim} != ({size})")
                continue
            namespace[f"D{index}"] = self._dtypes[index]
            namespace[f"V{index}"] = self._devices[index]
            on_device = _device_test(arg, index, self._devices[index])
            lines.append(f"        if {arg}.dtype is not D{index} or not ({on_device}):")
            lines.append("            return None")
            if all(isinstance(size, int) for size in spec.shape):
                # One C-level tuple comparison checks rank and every size at once.
                namespace[f"S{index}"] = tuple(spec.shape)
                lines.append(f"        if {arg}.shape != S{index}:")
                lines.append("            return None")
                continue
            lines.append(f"        sh = {arg}.shape")
            lines.append(f"        if len(sh) != {len(spec.shape)}:")
            lines.append("            return None")
            for dim, size in enumerate(spec.shape):
                if isinstance(size, int):
                    lines.append(f"        if sh[{dim}] != {size}:")
                    lines.append("            return None")
                elif size in self.symbols:
                    bind(size, f"sh[{dim}]")
                else:
                    lines.append(f"        d{index}_{dim} = sh[{dim}]")
                    deferred.append(f"d{index}_{dim} != ({size})")
        missing = [s for s in self.symbols if s not in assigned]
        if missing:
            raise CorruptArtifactError(f"symbols {missing} are not read from any input")
        for condition in deferred:
            check_expression(condition, [*self.symbols, *_locals(condition)])
            lines.append(f"        if {condition}:")
            lines.append("            return None")
        key = ", ".join(self.symbols) + ("," if len(self.symbols) == 1 else "")
        lines.append(f"        return ({key})")
        lines.append("    except (AttributeError, TypeError, IndexError):")
        lines.append("        return None")
        if guard is not None:
            namespace["GUARD"], namespace["CHECKED"] = guard, self._checked
        exec(compile("\n".join(lines) + "\n", "<precompile input contract>", "exec"), namespace)
        reader: KeyReader = namespace["read_key"]
        return reader

    # -- slow path -------------------------------------------------------------------
    def mismatch(self, args: Sequence[Any]) -> InputMismatchError:
        """Describe the first way ``args`` break the contract."""
        if len(args) != len(self.inputs):
            return InputMismatchError(
                f"expected {len(self.inputs)} flat inputs (the graph's placeholders, "
                f"SymInt placeholders as ints), got {len(args)}"
            )
        values: dict[str, tuple[int, str]] = {}
        deferred: list[tuple[str, int, str]] = []

        def record(name: str, value: int, where: str) -> InputMismatchError | None:
            if name in values and values[name][0] != value:
                first, origin = values[name]
                return InputMismatchError(
                    f"symbol {name} is {first} from {origin} but {value} from {where}; "
                    "the graph needs them equal"
                )
            values.setdefault(name, (value, where))
            return None

        for index, (spec, arg) in enumerate(zip(self.inputs, args, strict=True)):
            if isinstance(spec, IntInput):
                if type(arg) is not int:
                    return InputMismatchError(
                        f"input {index} should be an int (a SymInt placeholder), "
                        f"got {type(arg).__name__}"
                    )
                if isinstance(spec.value, int):
                    if arg != spec.value:
                        return InputMismatchError(
                            f"input {index} should be {spec.value}, got {arg}"
                        )
                elif spec.value in self.symbols:
                    error = record(spec.value, arg, f"input {index}")
                    if error:
                        return error
                else:
                    deferred.append((spec.value, arg, f"input {index}"))
                continue
            if not isinstance(arg, torch.Tensor):
                return InputMismatchError(
                    f"input {index} should be a {spec.dtype} tensor on {spec.device}, "
                    f"got {type(arg).__name__}"
                )
            if arg.dtype is not self._dtypes[index]:
                return InputMismatchError(
                    f"input {index} should have dtype {spec.dtype}, got {str(arg.dtype)[6:]}"
                )
            if arg.device != self._devices[index]:
                return InputMismatchError(
                    f"input {index} should be on device {spec.device}, got {arg.device}"
                )
            expected = "(" + ", ".join(str(s) for s in spec.shape) + ")"
            if arg.dim() != len(spec.shape):
                return InputMismatchError(
                    f"input {index} should have rank {len(spec.shape)} with shape {expected}, "
                    f"got shape {tuple(arg.shape)}"
                )
            for dim, size in enumerate(spec.shape):
                actual = int(arg.shape[dim])
                if isinstance(size, int):
                    if actual != size:
                        return InputMismatchError(
                            f"input {index} dim {dim} is static and must be {size} "
                            f"(shape {expected}), got shape {tuple(arg.shape)}"
                        )
                elif size in self.symbols:
                    error = record(size, actual, f"input {index} dim {dim}")
                    if error:
                        return error
                else:
                    deferred.append((size, actual, f"input {index} dim {dim}"))
        plain = {name: value for name, (value, _) in values.items()}
        for expression, actual, where in deferred:
            expected_value = compile_function([expression], self.symbols)(
                *(plain[s] for s in self.symbols)
            )[0]
            if actual != expected_value:
                return InputMismatchError(
                    f"{where} must equal {expression} = {expected_value}, got {actual}"
                )
        return InputMismatchError(f"inputs were rejected by the contract check: {args!r:.200}")


def _locals(condition: str) -> list[str]:
    """Names of the generated locals (``a3``, ``d3_1``) used in a deferred condition."""
    return sorted(set(re.findall(r"\b(?:a\d+|d\d+_\d+)\b", condition)))
