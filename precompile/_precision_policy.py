"""How compiled code rounds where eager rounds: dtype round trips and low-precision
intermediates, as eager computes them.

Eager rounds every op's result to its dtype: ``x.to(torch.bfloat16).to(torch.float32)``
loses the low bits of ``x``, and a bfloat16 model rounds each op's output to bfloat16.
Inductor fuses such ops into one kernel that computes in float32 and skips the rounding
in between, so a round trip is dropped (measured: a model scaling a bfloat16 round trip
by 1000.123 was answered 6.7% off eager, under plain ``torch.compile`` too). With
inductor's ``emulate_precision_casts`` a fused kernel rounds where eager would.

Options that set ``emulate_precision_casts`` (``options["config_patches"]``) are applied
inside the compile and so stay the caller's choice; the docs' benchmarks page gives what
the default costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._compiler_config import caller_switch

SWITCH = "emulate_precision_casts"
# What every variant's compile sets.
PATCHES: Mapping[str, Any] = {SWITCH: True}
# In every cache key: a build under another policy compiled other code.
POLICY = (
    "casts 1: fused kernels round where eager rounds (emulate_precision_casts), "
    "unless the caller chose"
)


def check_switch(options: Mapping[str, Any] | None) -> None:
    """The caller's ``emulate_precision_casts`` (in ``config_patches``), if any, is True or
    False; any other value is refused before any compile."""
    caller_switch(options, SWITCH)
