"""A variant compiled again loads from torch's AOTAutograd cache (its key tagged with the
variant's hints and what else torch's keys do not hash), never another variant's code, and
never a custom operator's implementation from before it changed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from conftest import capture
from torch._dynamo.utils import counters

import precompile


def _compile(model: torch.nn.Module, hints: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    captured = capture(model, torch.randn(4, 8))
    with torch.no_grad():
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=hints, cache=False
        )

    def call(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = artifact(*captured.flat(x))
        return out[0] if isinstance(out, (list, tuple)) else out

    return call


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def _hits() -> int:
    return int(counters["aot_autograd"]["autograd_cache_hit"])


def test_the_same_variant_compiled_again_loads_and_other_hints_compile() -> None:
    model = _Scaled().eval()
    x = torch.randn(6, 8)
    with torch.no_grad():
        expected = model(x)
    first = _compile(model, [4])
    before = _hits()
    again = _compile(model, [4])
    assert _hits() == before + 1  # one variant, loaded
    other = _compile(model, [16])
    assert _hits() == before + 1  # another hint: compiled, not another variant's code
    for call in (first, again, other):
        torch.testing.assert_close(call(x), expected)


def test_a_custom_op_whose_implementation_changed_is_compiled_again() -> None:
    """A custom op's CompositeImplicitAutograd kernel is inlined by the compile, and torch's
    keys name the op, not its kernel: a graph calling one is compiled afresh each time
    (a client trial's rebuild in a shared build dir ran the kernel of before, x*2+1 where
    eager gave x*3+1)."""
    library = torch.library.Library("precompile_rebuild_test", "DEF")
    library.define("scale(Tensor x) -> Tensor")
    factor = [2.0]
    library.impl("scale", lambda x: x * factor[0] + 1, "CompositeImplicitAutograd")

    class UsesTheOp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.precompile_rebuild_test.scale(x).relu()

    x = torch.randn(5, 8)
    try:
        first = _compile(UsesTheOp(), [4])
        torch.testing.assert_close(first(x), (x * 2 + 1).relu())
        factor[0] = 3.0
        before = _hits()
        second = _compile(UsesTheOp(), [4])
        assert _hits() == before
        torch.testing.assert_close(second(x), (x * 3 + 1).relu())
    finally:
        library._destroy()


def test_the_callers_own_cache_tag_stays_in_front() -> None:
    """A caller's ``cache_key_tag`` (their way to break torch's caches) still breaks ours."""
    model = _Scaled().eval()
    _compile(model, [8])
    before = _hits()
    with torch.compiler.config.patch(cache_key_tag="theirs"):
        _compile(model, [8])
        assert torch.compiler.config.cache_key_tag == "theirs"
    assert _hits() == before
