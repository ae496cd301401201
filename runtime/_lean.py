"""The lean path: a variant's generated code run directly, importing no torch compiler.

Upstream loads a variant by unpickling AOTAutograd's bundled entry, whose classes import
Dynamo, and by importing the generated wrapper module, whose header imports inductor's
``select_algorithm``, ``codecache`` and friends: about a second and a half of imports on
a 2-core CPU before the first call. Where the compile side proved the variant's wrapping
trivial, the manifest carries a ``LeanCall``: the wrapper module's source is executed
with its compiler imports served by stand-ins (``_torch_adapter.exec_lean_module``; C++
kernels come from the artifact's built binaries), and its ``call`` is wrapped with
exactly what AOTAutograd's inference wrapper would still do for this graph:

- grad mode off during the call (as upstream runs inference graphs), restored after;
- autocast off during the call if it was on when the variant was loaded (upstream
  decides that once, at load);
- the version counters of inputs the graph writes in place bumped before the call;
- the outputs as a list, of the length the graph returns (checked);
- outputs' dynamic dims marked for a Dynamo graph that consumes them;
- on GPUs, inputs compiled as 16-byte aligned copied to aligned memory where they are
  not (and copied back after the call where the graph writes them), as inductor does;
  Triton kernels launched from their shipped binaries (``_triton_launch``).

Anything else (a backward graph, input mutations replayed outside the graph, outputs
aliasing inputs, subclasses, RNG state, kernels inductor would not launch statically)
has no ``LeanCall`` and loads through upstream as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from precompile.cache import env_flag

from . import _native_kernels as native_kernels
from . import _torch_adapter as adapter
from ._errors import CorruptArtifactError
from ._manifest import LeanCall
from ._triton_launch import load_triton_kernels

GPU_ALIGNMENT = 16  # bytes: inductor's ALIGNMENT, what its GPU kernels assume of inputs


def lean_enabled() -> bool:
    """False where ``PRECOMPILE_LEAN=0``: every variant then loads through upstream (a
    switch to rule the lean path out when chasing a problem)."""
    return env_flag("PRECOMPILE_LEAN", default=True)


def _externs(lean: LeanCall) -> dict[str, Any]:
    table = {}
    for name, path in lean.externs.items():
        if not adapter.extern_path_names(name, path):
            raise CorruptArtifactError(
                f"the artifact's extern kernel {name} names {path}, another operator"
            )
        try:
            table[name] = adapter.resolve_torch_path(path)
        except (AttributeError, ValueError, RuntimeError) as exc:
            raise CorruptArtifactError(
                f"the artifact's extern kernel {name} names {path}, which this torch lacks ({exc})"
            ) from None
    return table


def load_lean(
    lean: LeanCall, source: str, name: str, read_payload: Callable[[str], bytes]
) -> Callable[..., Any]:
    """The callable running a lean variant: takes the graph's flat inputs, returns the
    list of its outputs (as upstream's loaded variants do). Raises
    ``adapter.LeanImportRefused`` where the module imports a compiler module after all."""
    triton = load_triton_kernels(lean.triton, read_payload) if lean.triton else None
    module = adapter.exec_lean_module(
        source, name, _externs(lean), native_kernels.load_cpp_pybinding, triton
    )
    call = getattr(module, "call", None)
    if not callable(call):
        raise CorruptArtifactError(f"the lean source of {name} defines no call")
    return _runner(call, lean, disable_autocast=torch._C._is_any_autocast_enabled())


def _runner(
    call: Callable[[list[Any]], Any], lean: LeanCall, *, disable_autocast: bool
) -> Callable[..., Any]:
    expected = lean.outputs
    bumps = lean.bump_versions
    marks = tuple((index, frozenset(dims)) for index, dims in lean.dynamic_dims)
    attribute = lean.dynamic_attribute or ""
    align = lean.align
    realign = frozenset(lean.realign)
    is_grad_enabled = torch.is_grad_enabled
    set_grad_enabled = torch._C._set_grad_enabled
    increment_version = torch.autograd.graph.increment_version
    no_autocast = torch._C._DisableAutocast

    def run(*args: Any) -> list[Any]:
        if bumps:
            increment_version(tuple(args[i] for i in bumps))
        inputs = list(args)
        moved = _realigned(inputs, align, realign) if align else None
        grad = is_grad_enabled()
        try:
            if grad:
                set_grad_enabled(False)
            if disable_autocast:
                with no_autocast():
                    outs = call(inputs)
            else:
                outs = call(inputs)
        finally:
            if grad:
                set_grad_enabled(True)
        if moved:
            torch._foreach_copy_([old for old, _ in moved], [new for _, new in moved])
        if isinstance(outs, tuple):
            outs = list(outs)
        elif not isinstance(outs, list):
            outs = [outs]
        if len(outs) != expected:
            raise CorruptArtifactError(
                f"the lean variant returned {len(outs)} outputs where its manifest says {expected}"
            )
        for index, dims in marks:
            _mark_dynamic(outs[index], attribute, dims)
        return outs

    run.lean = True  # type: ignore[attr-defined]
    return run


def _realigned(
    inputs: list[Any], align: tuple[int, ...], realign: frozenset[int]
) -> list[tuple[Any, Any]]:
    """Replace each listed input whose data is not 16-byte aligned by an aligned copy with
    the same sizes and strides (inductor's ``copy_misaligned_inputs``); the pairs of
    those the graph writes, to copy back after the call."""
    moved = []
    for index in align:
        tensor = inputs[index]
        if tensor.data_ptr() % GPU_ALIGNMENT:
            copy = _clone_preserving_strides(tensor)
            inputs[index] = copy
            if index in realign:
                moved.append((tensor, copy))
    return moved


def _clone_preserving_strides(tensor: torch.Tensor) -> torch.Tensor:
    if 0 in tensor.size():
        needed = 0
    else:
        needed = sum((n - 1) * s for n, s in zip(tensor.size(), tensor.stride(), strict=True)) + 1
    buffer = torch.as_strided(tensor, (needed,), (1,)).clone()
    return torch.as_strided(buffer, tensor.size(), tensor.stride())


def _mark_dynamic(tensor: Any, attribute: str, dims: frozenset[int]) -> None:
    """What AOTAutograd marks on an output whose dims were dynamic in the graph (torch
    2.13's ``mark_dynamo_propagated_dynamic_indices``, 2.11's ``maybe_mark_dynamic_helper``:
    the same but for the attribute's name)."""
    marked = getattr(tensor, attribute, None)
    if marked is not None:
        marked |= dims
    else:
        setattr(tensor, attribute, set(dims))
