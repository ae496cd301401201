"""Compiled code rounds where eager rounds: a dtype round trip that inductor's fusion
would drop (``x.to(bfloat16).to(float32)`` computed in float32 throughout) gives eager's
values bit for bit, through ``compile_model`` and ``standalone_compile``; the caller may
opt out by name (``precompile._precision_policy``)."""

from __future__ import annotations

import pytest
import torch
from conftest import capture

import precompile

SIZES = (3, 4, 17, 1)
OPT_OUT = {"config_patches": {"emulate_precision_casts": False}}


class RoundTrip(torch.nn.Module):
    """A bfloat16 round trip scaled up, as a mixed-precision model computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.compute_dtype = torch.bfloat16
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).to(self.compute_dtype).to(torch.float32) * 1000.123


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return RoundTrip().eval()


def _worst_relative_error(model: torch.nn.Module, call: object) -> float:
    worst = 0.0
    for n in SIZES:
        x = torch.randn(n, 16)
        expected, got = model(x), call(x)  # type: ignore[operator]
        worst = max(worst, float(((got - expected).abs() / expected.abs().clamp_min(1e-6)).max()))
    return worst


def test_compile_model_rounds_as_eager_at_every_size(model: torch.nn.Module) -> None:
    """Before, inductor dropped the round trip: 0.37% off eager on this model (6.7% in the
    report that found it)."""
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randn(8, 16),), dynamic={0: [0]}, hints=[8], cache=False, warmup=False
        )
        assert _worst_relative_error(model, compiled) == 0.0


def test_standalone_compile_rounds_as_eager(model: torch.nn.Module) -> None:
    captured = capture(model, torch.randn(8, 16))
    with torch.no_grad():
        artifact = precompile.standalone_compile(captured.gm, captured.example_inputs, cache=False)
        x = torch.randn(8, 16)
        (got,) = artifact(*captured.flat(x))
        assert torch.equal(got, model(x))


def test_the_callers_opt_out_compiles_inductors_fused_rounding(model: torch.nn.Module) -> None:
    """The switch is the caller's: with it off the round trip is dropped again (so the
    test above measures the policy, not a model inductor already rounds)."""
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randn(8, 16),), dynamic={0: [0]}, hints=[8], options=OPT_OUT,
            cache=False, warmup=False,
        )  # fmt: skip
        assert _worst_relative_error(model, compiled) > 1e-4


@pytest.mark.parametrize("value", [0, "False", None])
def test_the_opt_out_takes_true_or_false_only(model: torch.nn.Module, value: object) -> None:
    """Inductor reads 0 as False and "False" as True: refused before any compile."""
    captured = capture(model, torch.randn(6, 16))
    options = {"config_patches": {"emulate_precision_casts": value}}
    match = r"emulate_precision_casts.*True or False"
    with torch.no_grad():
        with pytest.raises(precompile.InvalidOptionError, match=match):
            precompile.compile_model(model, (torch.randn(6, 16),), options=options, cache=False)
        with pytest.raises(precompile.InvalidOptionError, match=match):
            precompile.standalone_compile(captured.gm, captured.example_inputs,
                                          options=options, cache=False)  # fmt: skip
    with pytest.raises(precompile.InvalidOptionError, match=match):  # when made, not called
        precompile.backend(options=options)
