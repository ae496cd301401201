"""Variant choice: exact sizes, guards, log2 distance, tie-break, memo, errors."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from synthetic_helpers import make_artifact

import precompile
from precompile.runtime import log2_distance


def x(*shape: int) -> torch.Tensor:
    return torch.empty(*shape)


def test_log2_distance_treats_zero_as_minus_one() -> None:
    assert log2_distance([0], [1]) == 1.0
    assert log2_distance([0], [0]) == 0.0
    assert log2_distance([8, 2], [2, 8]) == 4.0
    assert math.isclose(log2_distance([3], [4]), 2 - math.log2(3))


def test_nearest_hint_in_log2_space() -> None:
    art = make_artifact([("hint", {"s0": 16}, ()), ("hint", {"s0": 256}, ())])
    assert art(x(1, 4)) == 0
    assert art(x(63, 4)) == 0  # log2: 5.98 is nearer 4 than 8
    assert art(x(65, 4)) == 1
    assert art(x(100000, 4)) == 1
    assert art(x(0, 4)) == 0


def test_exact_size_wins_over_nearer_hint() -> None:
    art = make_artifact([("hint", {"s0": 64}, ()), ("static", {"s0": 60}, ("s0 == 60",))])
    assert art(x(60, 4)) == 1
    assert art(x(61, 4)) == 0
    assert art.explain(x(60, 4)).decided_by == "exact-size"


def test_guards_exclude_variants() -> None:
    art = make_artifact([("hint", {"s0": 1}, ("s0 == 1",)), ("hint", {"s0": 1024}, ("s0 >= 2",))])
    assert art(x(1, 4)) == 0
    assert art(x(2, 4)) == 1  # hint 1 is nearer, but its guard fails
    explanation = art.explain(x(2, 4))
    assert explanation.candidates[0].failed_guards == ("s0 == 1",)
    assert explanation.candidates[1].admissible
    assert "guards fail: s0 == 1" in str(explanation)


def test_a_tie_goes_to_the_larger_hint_then_to_the_first_listed() -> None:
    art = make_artifact([("hint", {"s0": 2}, ()), ("hint", {"s0": 8}, ())])
    assert art(x(4, 4)) == 1  # distance 1 to both
    assert art.explain(x(4, 4)).decided_by == "nearest-hint"
    twins = make_artifact([("hint", {"s0": 8}, ()), ("hint", {"s0": 8}, ())])
    assert twins(x(4, 4)) == 0
    art_2d = make_artifact(
        [("hint", {"b": 4, "s": 1}, ()), ("hint", {"b": 1, "s": 16}, ())],
        symbols=("b", "s"),
        shape=("b", "s", 4),
    )
    assert art_2d(x(2, 4, 4)) == 1  # distance 3 to both; 1x16 has the larger log2 sum


def test_two_dimensional_distance() -> None:
    art = make_artifact(
        [
            ("hint", {"b": 1, "s": 1024}, ()),
            ("hint", {"b": 64, "s": 16}, ()),
        ],
        symbols=("b", "s"),
        shape=("b", "s", 4),
    )
    assert art(x(2, 512, 4)) == 0
    assert art(x(32, 32, 4)) == 1


def test_no_variant_error_says_why() -> None:
    art = make_artifact([("hint", {"s0": 8}, ("s0 <= 100",))])
    with pytest.raises(precompile.NoVariantError, match=r"s0 <= 100") as info:
        art(x(101, 4))
    assert isinstance(info.value, ValueError)
    assert "never compiles" in str(info.value)


def test_symbol_bounds_are_checked() -> None:
    from precompile.runtime import Symbol

    art = make_artifact([("hint", {"s0": 8}, ())])
    manifest = art.manifest
    bounded = type(manifest)(
        manifest.environment,
        (Symbol("s0", manifest.symbols[0].sources, 4, 64),),
        manifest.inputs,
        manifest.variants,
    )
    loaded = {manifest.variants[0].payload: lambda *a: 0}
    art = precompile.CompiledArtifact(bounded, art._payloads, loaded=loaded)
    assert art(x(4, 4)) == 0
    with pytest.raises(precompile.NoVariantError, match="s0 >= 4"):
        art(x(3, 4))
    with pytest.raises(precompile.NoVariantError, match="s0 <= 64"):
        art(x(65, 4))


def test_choice_is_memoized_and_bounded() -> None:
    art = make_artifact([("hint", {"s0": 8}, ()), ("hint", {"s0": 64}, ())], memo_size=3)
    for n in range(1, 50):
        art(x(n, 4))
    assert len(art._memo) == 3
    chosen = art(x(49, 4))
    assert art._memo[(49,)]() == chosen


def test_memoized_path_runs_variant_once_per_call() -> None:
    calls: list[int] = []
    art = make_artifact([("hint", {"s0": 8}, ())], calls=calls)
    for _ in range(5):
        art(x(8, 4))
    assert calls == [0] * 5


def test_concurrent_calls_agree() -> None:
    art = make_artifact([("hint", {"s0": 4}, ()), ("hint", {"s0": 256}, ())], memo_size=8)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for step in range(1, 300):
                n = (step * (offset + 1)) % 299 + 1
                expected = 0 if n < 32 else 1  # 32 is equidistant: the larger hint wins
                assert art(x(n, 4)) == expected
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "expected 1 flat inputs"),
        ((torch.empty(3, 5),), "dim 1 is static and must be 4"),
        ((torch.empty(3, 4, 1),), "rank 2"),
        ((torch.empty(3, 4, dtype=torch.float16),), "dtype float32, got float16"),
        ((torch.empty(3, 4, device="meta"),), "device cpu, got meta"),
        (([[1.0] * 4] * 3,), "should be a float32 tensor on cpu, got list"),
    ],
)
@pytest.mark.parametrize("after_a_good_call", [False, True])  # Python check, then C++ guard
def test_input_mismatch_names_input_and_expectation(
    args: tuple[object, ...], message: str, after_a_good_call: bool
) -> None:
    art = make_artifact([("hint", {"s0": 8}, ())])
    if after_a_good_call:
        assert art(x(3, 4)) == 0
    with pytest.raises(precompile.InputMismatchError, match=message) as info:
        art(*args)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (torch.empty(4, 5), "dim 1 is static and must be 4"),
        (torch.empty(4, 4, dtype=torch.float64), "dtype float32, got float64"),
        (torch.empty(4), "rank 2"),
        (3, "should be a float32 tensor"),
    ],
)
def test_a_static_input_read_only_by_the_cpp_guard_is_still_checked(
    weight: object, message: str
) -> None:
    art = make_artifact([("hint", {"s0": 8}, ())], weight=(4, 4))
    assert art(x(3, 4), x(4, 4)) == 0  # installs the C++ guard; the weight is left to it
    assert "GUARD" in art._contract.read_key.__code__.co_names
    with pytest.raises(precompile.InputMismatchError, match=message) as info:
        art(x(3, 4), weight)
    assert "input 1" in str(info.value)


def test_symbol_used_twice_must_agree() -> None:
    art = make_artifact([("hint", {"s0": 8}, ())], shape=("s0", "s0"))
    assert art(x(5, 5)) == 0
    with pytest.raises(precompile.InputMismatchError, match=r"symbol s0 is 5 .* but 6"):
        art(x(5, 6))


def test_compound_dim_is_checked() -> None:
    art = make_artifact([("hint", {"s0": 8}, ())], shape=("s0", "2*s0"))
    assert art(x(3, 6)) == 0
    with pytest.raises(precompile.InputMismatchError, match=r"must equal 2\*s0 = 6, got 7"):
        art(x(3, 7))


def test_guarded_fast_path_is_installed_and_falls_back_when_it_says_no() -> None:
    art = make_artifact([("hint", {"s0": 8}, ())], shape=("s0", "s0"))
    assert art(x(5, 5)) == 0
    reader = art._contract.read_key
    assert "GUARD" in reader.__code__.co_names  # the C++ tensor check runs first now
    assert art.sizes_of(x(7, 7)) == {"s0": 7}
    with torch.inference_mode():  # other dispatch keys: the guard says no, Python says yes
        assert art(x(6, 6)) == 0
    grad = x(4, 4).requires_grad_()
    with torch.no_grad():  # requires_grad differs from the template: Python says yes
        assert art.sizes_of(grad) == {"s0": 4}
    with pytest.raises(precompile.InputMismatchError, match="requires grad"):
        art(grad)  # an inference artifact would return an output cut off from autograd
