"""The process-wide state a trace reads: what Dynamo's global-state guard checks (grad
mode, autocast per device with its dtype, default dtype, deterministic algorithms,
matmul precision, torch-function state), the torch-function mode stack Dynamo guards
beside it, and the torch-dispatch mode stack (a mode active at a call sees the aten ops
eager runs, not a compiled kernel's: a mode that changes results was served the compiled
values, 100 off, until a call under one was refused). Inference mode is grad mode off
to these guards (and to inductor's and AOTAutograd's cache keys): a graph compiled
under ``no_grad`` serves ``inference_mode``.

A graph traced under ``torch.autocast`` holds bf16 ops; one traced with grad enabled
holds a backward. So this state is a factor of every cache key (the backend's, the
standalone graph's and the model's), and a compiled model checks it on every call.
The check is torch's own C++ guard (about 0.25 us) over the recorded state; the
thread count, which that guard also holds, is not part of the state: it changes no
traced graph, only how CPU kernels split their work (and it differs between the
machine that compiles and the one that serves).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from ._dtypes import dtype_name
from ._errors import InputMismatchError

_THREADS = "num_threads"


def _guard_state() -> dict[str, Any]:
    """torch's global-state guard's own record of the state now (its JSON)."""
    state = json.loads(torch._C._dynamo.guards.GlobalStateGuard().__getstate__())
    if not isinstance(state, dict):
        raise TypeError("torch's GlobalStateGuard state is not a JSON object")
    return state


def _autocast() -> dict[str, str]:
    found = {}
    for device in torch._C._autocast_supported_devices():
        if torch.is_autocast_enabled(device):
            found[device] = dtype_name(torch.get_autocast_dtype(device))
    return found


def _mode_stack() -> list[str]:
    count = torch._C._len_torch_function_stack()
    return [
        f"{type(m).__module__}.{type(m).__qualname__}"
        for m in (torch._C._get_function_stack_at(i) for i in range(count))
    ]


def _dispatch_stack() -> list[str]:
    count = torch._C._len_torch_dispatch_stack()
    return [
        f"{type(m).__module__}.{type(m).__qualname__}"
        for m in (torch._C._get_dispatch_stack_at(i) for i in range(count))
    ]


def trace_state() -> dict[str, Any]:
    """The state now, as JSON: what a key holds and a compiled model checks."""
    guard = _guard_state()
    grad = torch.is_grad_enabled()
    hooks = {}
    if grad:  # saved-tensor hooks (activation offloading, say) act on a backward graph
        hooks["saved_tensors_hooks"] = (
            torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        )
    return {
        **hooks,
        "grad_mode": grad,
        "autocast": _autocast(),
        "default_dtype": dtype_name(torch.get_default_dtype()),
        "deterministic_algorithms": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ],
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "reduced_precision_reduction": [
            guard.get("allow_fp16_reduce"),
            guard.get("allow_bf16_reduce"),
        ],
        "torch_function": [guard.get("torch_function"), guard.get("torch_function_all_disabled")],
        "torch_function_modes": _mode_stack(),
        "torch_dispatch_modes": _dispatch_stack(),
        # the raw guard state (less the thread count): what the per-call check loads
        "guard": {k: v for k, v in guard.items() if k != _THREADS},
    }


def describe(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state without its raw guard record: what a message shows."""
    return {k: v for k, v in state.items() if k != "guard"}


class StateCheck:
    """Per call: is the process-wide state the recorded one? torch's C++ guard answers
    the common case; a failure is explained field by field (or passes, where only the
    thread count moved: the guard is then rebuilt for it)."""

    __slots__ = ("_dispatch", "_guard", "_hooks", "_modes", "_recorded", "_where")

    def __init__(self, recorded: Mapping[str, Any], where: str) -> None:
        self._recorded = dict(recorded)
        self._where = where
        self._modes = bool(recorded.get("torch_function_modes"))
        self._dispatch = bool(recorded.get("torch_dispatch_modes"))
        self._hooks = "saved_tensors_hooks" in recorded
        self._guard: Any = None
        self._rebuild()

    def _rebuild(self) -> None:
        raw = dict(self._recorded.get("guard") or {})
        if not raw:
            self._guard = None
            return
        raw[_THREADS] = torch.get_num_threads()
        guard = torch._C._dynamo.guards.GlobalStateGuard()
        try:
            guard.__setstate__(json.dumps(raw))
        except Exception:  # another torch's record: compare field by field instead
            self._guard = None
            return
        self._guard = guard

    def check(self) -> None:
        guard = self._guard
        if (
            guard is not None
            and guard.check()
            and torch._C._len_torch_function_stack() == 0
            and torch._C._len_torch_dispatch_stack() == 0
            and not self._modes
            and not self._dispatch
            and not (
                self._hooks
                and (torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
                != self._recorded["saved_tensors_hooks"]
            )
        ):
            return
        self._slow_check()

    def _slow_check(self) -> None:
        now = trace_state()
        differing = [
            k
            for k in {**describe(self._recorded), "torch_dispatch_modes": []}
            if self._recorded.get(k, []) != now.get(k)
        ]
        if not differing:
            self._rebuild()  # the thread count moved, or the raw record is another torch's
            return
        said = "; ".join(
            f"{k} is {now.get(k)!r}, compiled under {self._recorded.get(k, [])!r}"
            for k in differing
        )
        raise InputMismatchError(
            f"{self._where} was traced under other global state: {said}. Call it under the "
            "state it was compiled in, or compile it under this one"
        )
