"""Measured dispatch: the table's logic with a fake timer, persistence, device checks."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from conftest import MLP_HINTS, MLP_SIZES, Compiled, assert_close

import precompile
from precompile.runtime import Calibration, CalibrationEntry, Manifest
from precompile.runtime.compiler_interface import MemoryPayloads

# The mlp fixture's variants: 0 hint s=1, 1 hint s=16, 2 hint s=256, 3 static s=3.
assert (MLP_HINTS, MLP_SIZES) == ([1, 16, 256], [3])


def fake_timer(
    fastest: Callable[[int], int], ran: list[tuple[int, tuple[int, ...]]] | None = None
) -> Callable[[Callable[[], Any], int, tuple[int, ...]], float]:
    """Says variant ``fastest(size)`` takes 1 ms and every other one 2 ms (and runs it)."""

    def timer(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
        call()
        if ran is not None:
            ran.append((variant, point))
        return 1e-3 if variant == fastest(point[0]) else 2e-3

    return timer


def fresh(mlp: Compiled) -> precompile.CompiledArtifact:
    art = mlp.artifact
    payloads = {d: art.payload_bytes(d) for d in art.manifest.payload_digests}
    manifest = dataclasses.replace(art.manifest, calibration=None)
    return precompile.CompiledArtifact(manifest, MemoryPayloads(payloads))


def args_at(mlp: Compiled, n: int) -> list[Any]:
    return mlp.captured.flat(torch.randn(n, 32))


def test_measured_winner_decides_inside_the_sampled_range(mlp: Compiled) -> None:
    art = fresh(mlp)
    ran: list[tuple[int, tuple[int, ...]]] = []
    table = art.calibrate([2, 16, 64, 256], timer=fake_timer(lambda n: 2, ran))
    # Only admissible variants ran: hint 1 is guarded to s == 1, static 3 to s == 3.
    # Each in 3 rounds (the default).
    assert sorted(ran) == sorted((v, (n,)) for n in [2, 16, 64, 256] for v in (1, 2) for _ in "abc")
    assert [e.best for e in table.entries] == [2, 2, 2, 2]
    assert all(e.margin == pytest.approx(1.0) for e in table.entries)
    explained = art.explain(*args_at(mlp, 16))
    assert (explained.chosen, explained.decided_by) == (2, "calibrated")  # heuristic: 1
    assert art.explain(*args_at(mlp, 1)).decided_by != "calibrated"  # below the range
    assert art.explain(*args_at(mlp, 1000)).decided_by == "nearest-hint"  # above it
    # Size 3 has an exact variant and was not sampled: the measurements elsewhere do
    # not overrule it.
    assert art.explain(*args_at(mlp, 3)).decided_by == "exact-size"
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert_close(art(*mlp.captured.flat(x)), mlp.captured.model(x))


def test_a_sample_at_an_exact_size_can_overrule_it(mlp: Compiled) -> None:
    art = fresh(mlp)
    table = art.calibrate([3, 16], timer=fake_timer(lambda n: 1))
    assert set(table.entries[0].times) == {1, 2, 3}  # the static variant was measured
    explained = art.explain(*args_at(mlp, 3))
    assert (explained.chosen, explained.decided_by) == (1, "calibrated")


def test_regions_split_at_the_geometric_midpoint(mlp: Compiled) -> None:
    art = fresh(mlp)
    art.calibrate([4, 16, 64, 256], timer=fake_timer(lambda n: 1 if n <= 16 else 2))
    # 32 is the midpoint of samples 16 and 64: a tie, which goes to the larger sample
    assert [art.variant_for(*args_at(mlp, n)) for n in (5, 31, 32, 33, 200)] == [1, 1, 2, 2, 2]


def test_the_table_survives_save_and_load(
    mlp: Compiled, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    art = fresh(mlp)
    table = art.calibrate([2, 16, 256], timer=fake_timer(lambda n: 2))
    for fmt in ("binary", "unpacked"):
        path = os.path.join(str(tmp_path), f"calibrated-{fmt}")
        art.save(path=path, format=fmt)  # type: ignore[arg-type]
        loaded = precompile.CompiledArtifact.load(path=path, format=fmt)  # type: ignore[arg-type]
        assert loaded.manifest.calibration == table
        assert loaded.explain(*args_at(mlp, 16)).decided_by == "calibrated"


def test_a_table_from_another_device_is_ignored_with_a_warning(
    mlp: Compiled, caplog: pytest.LogCaptureFixture
) -> None:
    art = fresh(mlp)
    foreign = Calibration("Imaginary GPU 9000", "fake", (CalibrationEntry((16,), {2: 1e-3}),))
    manifest = dataclasses.replace(art.manifest, calibration=foreign)
    payloads = {d: art.payload_bytes(d) for d in manifest.payload_digests}
    with caplog.at_level(logging.WARNING, logger="precompile"):
        moved = precompile.CompiledArtifact(manifest, MemoryPayloads(payloads))
    assert "Imaginary GPU 9000" in caplog.text
    assert moved.explain(*args_at(mlp, 16)).decided_by == "nearest-hint"


def test_rounds_interleave_the_variants_and_a_one_off_slow_window_does_not_flip_it(
    mlp: Compiled,
) -> None:
    ran: list[tuple[int, tuple[int, ...]]] = []

    def sagging(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
        ran.append((variant, point))
        if variant == 2 and ran.count((2, point)) == 1:
            return 9e-3  # variant 2 is faster, but its first timing window ran slow
        return 1e-3 if variant == 2 else 2e-3

    art = fresh(mlp)
    table = art.calibrate([64], timer=sagging)
    assert [v for v, _ in ran] == [1, 2, 2, 1, 1, 2]  # turns rotate round by round
    assert table.entries[0].best == 2
    assert table.entries[0].times == {1: 2e-3, 2: 1e-3}
    single = fresh(mlp)
    ran.clear()
    assert single.calibrate([64], timer=sagging, rounds=1).entries[0].best == 1
    with pytest.raises(precompile.InvalidOptionError, match="rounds"):
        fresh(mlp).calibrate([64], timer=sagging, rounds=0)


def test_a_round_covers_every_point_so_a_slow_stretch_spoils_one_timing_per_entry(
    mlp: Compiled,
) -> None:
    """Two timings in a row run 10x slow. Were an entry's rounds back to back, both
    would be the faster variant 2 at size 16, and its median would flip the choice."""
    ran: list[tuple[int, tuple[int, ...]]] = []

    def stretch(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
        ran.append((variant, point))
        slow = 10.0 if len(ran) in (2, 3) else 1.0
        return slow * (1e-3 if variant == 2 else 2e-3)

    table = fresh(mlp).calibrate([16, 64, 256], timer=stretch)
    assert ran[:6] == [(1, (16,)), (2, (16,)), (1, (64,)), (2, (64,)), (1, (256,)), (2, (256,))]
    assert [e.best for e in table.entries] == [2, 2, 2]
    assert table.entries[0].times == {1: 2e-3, 2: 1e-3}


def test_a_gain_within_min_gain_does_not_overrule_the_compile_time_choice(
    mlp: Compiled, tmp_path: object
) -> None:
    def timer(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
        if point == (16,):  # hint 256 only 2% ahead of hint 16, the nearest point
            return 0.98e-3 if variant == 2 else 1e-3
        return 1e-3 if variant == 1 else 1.1e-3  # at 64 hint 16 is 10% ahead

    art = fresh(mlp)
    table = art.calibrate([16, 64], timer=timer)
    assert table.min_gain == 0.05 and [e.best for e in table.entries] == [2, 1]
    at_16, at_64 = art.explain(*args_at(mlp, 16)), art.explain(*args_at(mlp, 64))
    assert (at_16.chosen, at_16.decided_by) == (1, "nearest-hint")
    assert (at_64.chosen, at_64.decided_by) == (1, "calibrated")  # the log2 tie said 2
    path = os.path.join(str(tmp_path), "gain.pt2c")
    art.save(path=path)
    loaded = precompile.CompiledArtifact.load(path=path)
    assert loaded.manifest.calibration == table
    assert loaded.explain(*args_at(mlp, 16)).chosen == 1
    eager = fresh(mlp)
    eager.calibrate([16, 64], timer=timer, min_gain=0)
    assert eager.explain(*args_at(mlp, 16)).decided_by == "calibrated"
    assert eager.variant_for(*args_at(mlp, 16)) == 2
    for bad in (-0.1, float("nan"), "5%", True):
        with pytest.raises(precompile.InvalidOptionError, match="min_gain"):
            fresh(mlp).calibrate([16], timer=timer, min_gain=bad)  # type: ignore[arg-type]
    document = loaded.manifest.to_json()
    document["calibration"]["min_gain"] = -1
    with pytest.raises(precompile.CorruptArtifactError, match="min_gain"):
        Manifest.from_json(document)


def test_the_default_wall_timer_measures_real_calls(mlp: Compiled) -> None:
    art = fresh(mlp)
    x = torch.randn(7, 32)
    table = art.calibrate([2, 64], inputs=mlp.captured.flat(x), warmup=2, reps=5)
    assert table.method.startswith("wall clock")
    assert all(t > 0 for e in table.entries for t in e.times.values())
    assert [sorted(e.times) for e in table.entries] == [[1, 2], [1, 2]]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([], "non-empty"),
        ("16", "non-empty list"),
        ([-1], "non-negative"),
        ([{"nope": 4}], "must name exactly"),
        ([(1, 2)], "does not match"),
    ],
)
def test_bad_sample_sizes_are_refused(mlp: Compiled, sizes: Any, message: str) -> None:
    with pytest.raises(precompile.InvalidOptionError, match=message):
        fresh(mlp).calibrate(sizes, timer=fake_timer(lambda n: 1))


@pytest.mark.parametrize(
    ("calibrate", "message"), [({"reps": 3}, "needs 'sizes'"), (16, "list of sample sizes")]
)
def test_bad_calibrate_option_is_refused(mlp: Compiled, calibrate: Any, message: str) -> None:
    with pytest.raises(precompile.InvalidOptionError, match=message):
        precompile.standalone_compile(
            mlp.captured.gm, mlp.captured.example_inputs, hints=[16], calibrate=calibrate
        )


def test_standalone_compile_calibrates_and_caches_the_table(
    mlp: Compiled, tmp_path: object
) -> None:
    cache = precompile.ArtifactCache(os.path.join(str(tmp_path), "cache"))
    option: Mapping[str, Any] = {
        "sizes": [2, 64],
        "timer": fake_timer(lambda n: 2),
        "min_gain": 0.5,
    }
    with torch.no_grad():
        first = precompile.standalone_compile(
            mlp.captured.gm, mlp.captured.example_inputs, hints=[16, 256], cache=cache,
            calibrate=option,
        )  # fmt: skip
        again = precompile.standalone_compile(
            mlp.captured.gm, mlp.captured.example_inputs, hints=[16, 256], cache=cache,
            calibrate=option,
        )  # fmt: skip
    assert first.manifest.calibration is not None
    assert first.manifest.calibration.min_gain == 0.5
    assert again.manifest.calibration == first.manifest.calibration
    assert cache.stats().hits == 1


def test_a_boolean_where_the_manifest_wants_a_number_is_corrupt(mlp: Compiled) -> None:
    art = fresh(mlp)
    art.calibrate([16], timer=fake_timer(lambda n: 1))
    for field_path in ("min_gain", "times"):
        document = art.manifest.to_json()
        if field_path == "min_gain":
            document["calibration"]["min_gain"] = True
        else:
            document["calibration"]["entries"][0]["times"]["1"] = True
        with pytest.raises(precompile.CorruptArtifactError, match="int/float, got True"):
            Manifest.from_json(document)
