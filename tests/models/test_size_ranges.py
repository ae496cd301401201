"""Declared size ranges (``compile_model(dynamic={arg: {dim: (least, most)}})``): a least
of 2 or more traces no length at 1, and every call outside a range is refused by name,
here, after a save and in a fresh process; nothing outside is ever answered from a graph
traced for other sizes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_python

import precompile


class SumOrTriple(torch.nn.Module):
    """Rows summed, but a single row tripled: Dynamo's trace at 2 and more never sees the
    second branch, so serving a row of 1 from it would be a wrong answer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0) if x.shape[0] > 1 else x[0] * 3


class Lengths(torch.nn.Module):
    """Batch and sequence dynamic, each branching at 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sum(0) if x.shape[0] > 1 else x[0] * 3
        return y.cumsum(0) if y.shape[0] > 1 else y - 1


@pytest.fixture(scope="module")
def ranged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    store = str(tmp_path_factory.mktemp("ranges"))
    with torch.no_grad():
        compiled = precompile.compile_model(
            SumOrTriple(), (torch.randn(4, 3),), dynamic={0: {0: (2, 16)}}, hints=[8],
            cache=store,
        )  # fmt: skip
    return compiled, store


def test_a_least_of_two_traces_nothing_at_1_and_refuses_sizes_outside(
    ranged: tuple[Any, str],
) -> None:
    compiled, _ = ranged
    assert compiled.pieces == {}  # one trace: the length at 1 was never traced
    assert compiled.refused_at_one() == [("argument 0", 0)]
    with torch.no_grad():
        for rows in (2, 5, 16):
            x = torch.randn(rows, 3)
            torch.testing.assert_close(compiled(x), SumOrTriple()(x))
        for rows in (1, 17, 0):
            with pytest.raises(precompile.NoVariantError, match=r"argument 0 dim 0 is \d+"):
                compiled(torch.randn(rows, 3))


def test_a_declared_range_is_kept_by_the_store_and_checked_in_a_fresh_process(
    ranged: tuple[Any, str],
) -> None:
    _, store = ranged
    out = run_python(
        f"""
        import sys, torch, precompile
        sys.path[:0] = ["tests", "tests/models"]
        from test_size_ranges import SumOrTriple
        torch.set_grad_enabled(False)
        compiled = precompile.compile_model(
            SumOrTriple(), (torch.randn(4, 3),), dynamic={{0: {{0: (2, 16)}}}}, hints=[8],
            cache={store!r}, compile=False,
        )
        x = torch.randn(9, 3)
        torch.testing.assert_close(compiled(x), SumOrTriple()(x))
        for rows in (1, 17):
            try:
                compiled(torch.randn(rows, 3))
            except precompile.NoVariantError as exc:
                print(rows, exc)
        # the range is part of the key: the same call without it is another entry
        try:
            precompile.compile_model(SumOrTriple(), (torch.randn(4, 3),), dynamic={{0: [0]}},
                                     hints=[8], cache={store!r}, compile=False)
        except precompile.ArtifactNotFoundError:
            print("no entry without the range")
        """
    )
    assert "1 argument 0 dim 0 is 1, outside the range [2, 16]" in out
    assert "17 argument 0 dim 0 is 17, outside the range [2, 16]" in out
    assert "no entry without the range" in out


def test_a_range_on_one_length_leaves_the_others_traced_at_1(tmp_path: Any) -> None:
    """Sequence from 2 up to 8, batch from 1: two traces (batch at 1 is a piece of its
    own), not four; the piece keeps the sequence's range."""
    with torch.no_grad():
        compiled = precompile.compile_model(
            Lengths(), (torch.randn(3, 5),), dynamic={0: {0: None, 1: (2, 8)}}, hints=[4],
            cache=str(tmp_path),
        )  # fmt: skip
        assert [sorted(ones) for ones in compiled.pieces] == [[0]]
        for shape in ((3, 5), (1, 5), (1, 2), (7, 8)):
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), Lengths()(x))
        for shape in ((3, 1), (1, 1), (3, 9), (1, 9)):
            with pytest.raises(precompile.NoVariantError, match="argument 0 dim 1 is"):
                compiled(torch.randn(*shape))


def test_a_range_is_a_torch_export_dim_too_and_bad_ranges_are_refused_before_a_trace() -> None:
    from torch.export import Dim

    example = (torch.randn(4, 3),)
    with torch.no_grad():
        compiled = precompile.compile_model(
            SumOrTriple(), example, dynamic={0: {0: Dim("rows", min=2, max=16)}}, hints=[8],
            cache=False,
        )  # fmt: skip
        with pytest.raises(precompile.NoVariantError, match=r"range \[2, 16\]"):
            compiled(torch.randn(1, 3))
        # a Dim's defaults (no bound above), and NumPy's ints, are ranges too
        unbounded = precompile.compile_model(
            SumOrTriple(), example, dynamic={0: {0: Dim("rows", max=64)}}, hints=[8],
            cache=False,
        )  # fmt: skip
        assert unbounded.pieces  # from 1: traced at 1 too
        with pytest.raises(precompile.NoVariantError, match=r"range \[1, 64\]"):
            unbounded(torch.randn(65, 3))
        precompile.compile_model(SumOrTriple(), example, dynamic={0: {0: Dim("any")}},
                                 hints=[8], cache=False)  # fmt: skip
        precompile.compile_model(SumOrTriple(), example, dynamic={0: {0: (np.int64(2), None)}},
                                 hints=[8], cache=False)  # fmt: skip
    cases = [
        ({0: {0: (0, 8)}}, [8], "least size must be at least 1"),
        ({0: {0: (3, 3)}}, [3], "leaves no dynamic range"),  # one size is a static dim
        ({0: {True: (2, 8)}}, [8], "a dim is an int index"),
        ({0: {(2, 8)}}, [8], "must be a list of dims or a dict"),  # a set by mistake
        ({0: "0"}, [8], "must be a list of dims or a dict"),
        ({0: {0: (2, 8)}}, {(0, 1): [4]}, "dim 1 of argument 0 is not a dynamic dim"),
        ({0: [0]}, {(0, 0): [0]}, "a hint is a size of 1 or more"),
        ({0: {0: (5, 8)}}, [8], "is 4 in the example call, outside its declared range"),
        ({0: {0: (2, 1)}}, [8], "leaves no dynamic range"),
        ({0: {0: (2, 8, 9)}}, [8], "a range is"),
        ({0: {0: "wide"}}, [8], "a range is"),
        ({0: {0: (2.0, None)}}, [8], "must be an int"),
        ({0: {0: np.array([2, 8])}}, [8], "a range is"),  # a min and a max, but not a Dim
        ({0: {0: (2, 8)}}, [16], "hint 16 .* outside its declared range .* per dim"),
        ({0: {0: (2, 8)}}, {(0, 0): [1]}, "hint 1 for argument 0 dim 0 is outside"),
    ]
    for dynamic, hints, message in cases:
        with pytest.raises(precompile.InvalidOptionError, match=message):
            precompile.compile_model(SumOrTriple(), example, dynamic=dynamic, hints=hints,
                                     cache=False)  # fmt: skip
    with pytest.raises(precompile.InvalidOptionError, match="size 12 for argument 0 dim 0"):
        precompile.compile_model(SumOrTriple(), example, dynamic={0: {0: (2, 8)}}, sizes=[12],
                                 cache=False)  # fmt: skip


class ThresholdAt13(torch.nn.Module):
    """The model's own code guards the length: its trace serves 2 to 13 only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[1] > 13 else x + 1


def test_a_declared_range_the_trace_cuts_short_is_refused_at_compile_time() -> None:
    """Found by a docs-only client trial: a range of [2, 20] over a trace that holds only
    to 13 compiled, and calls at 14-20 (inside the declared range) were refused in the
    guards' symbols. The compile now refuses it, naming the dim and the guard, as
    ``torch.export`` refuses a violated constraint; a range the trace holds compiles."""
    example = (torch.randn(3, 6),)
    with torch.no_grad():
        for declared, said in (
            ((2, 20), "does not serve 20: it holds only where"),
            ((2, None), r"serves it up to 13 only .* declare \(2, 13\)"),
        ):
            with pytest.raises(precompile.UnsupportedGraphError, match=said) as refused:
                precompile.compile_model(ThresholdAt13(), example, dynamic={0: {1: declared}},
                                         cache=False)  # fmt: skip
            assert "argument 0 dim 1 was declared" in str(refused.value)
        compiled = precompile.compile_model(ThresholdAt13(), example, dynamic={0: {1: (2, 13)}},
                                            cache=False)  # fmt: skip
        for length in (2, 13):
            x = torch.randn(3, length)
            torch.testing.assert_close(compiled(x), ThresholdAt13()(x))
