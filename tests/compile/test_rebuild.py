"""A variant compiled again is compiled again: torch's AOTAutograd cache checks a found
entry's guards against the hints and does not add them to the compile's ShapeEnv, which
is where a variant's guards are read, so the build empties it before each variant (a
variant loaded from it had only the range guards left: measured, not kept). A custom
op's implementation is read afresh too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from conftest import capture
from torch._dynamo.utils import counters

import precompile


def _compile(model: torch.nn.Module, hints: list[int]) -> tuple[Callable[..., torch.Tensor], Any]:
    captured = capture(model, torch.randn(4, 8))
    with torch.no_grad():
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=hints, cache=False
        )

    def call(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = artifact(*captured.flat(x))
        return out[0] if isinstance(out, (list, tuple)) else out

    return call, artifact


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def _hits() -> int:
    return int(counters["aot_autograd"]["autograd_cache_hit"])


def test_a_variant_compiled_again_is_compiled_with_the_same_guards() -> None:
    model = _Scaled().eval()
    x = torch.randn(6, 8)
    with torch.no_grad():
        expected = model(x)
    first, first_artifact = _compile(model, [4, 16])
    before = _hits()
    again, again_artifact = _compile(model, [4, 16])
    assert _hits() == before  # nothing loaded from AOTAutograd's cache
    guards = [variant.guards for variant in first_artifact.manifest.variants]
    assert [variant.guards for variant in again_artifact.manifest.variants] == guards
    for call in (first, again):
        torch.testing.assert_close(call(x), expected)


def test_a_custom_op_whose_implementation_changed_is_compiled_again() -> None:
    """A custom op's CompositeImplicitAutograd kernel is inlined by the compile, and torch's
    keys name the op, not its kernel (a client trial's rebuild in a shared build dir, with
    torch's cache reused, ran the kernel of before: x*2+1 where eager gave x*3+1)."""
    library = torch.library.Library("precompile_rebuild_test", "DEF")
    library.define("scale(Tensor x) -> Tensor")
    factor = [2.0]
    library.impl("scale", lambda x: x * factor[0] + 1, "CompositeImplicitAutograd")

    class UsesTheOp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.precompile_rebuild_test.scale(x).relu()

    x = torch.randn(5, 8)
    try:
        first, _ = _compile(UsesTheOp(), [4])
        torch.testing.assert_close(first(x), (x * 2 + 1).relu())
        factor[0] = 3.0
        second, _ = _compile(UsesTheOp(), [4])
        torch.testing.assert_close(second(x), (x * 3 + 1).relu())
    finally:
        library._destroy()
