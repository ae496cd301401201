"""hints= and sizes= expansion and validation (no compiling)."""

from __future__ import annotations

import logging

import pytest

from precompile import InvalidOptionError
from precompile._variant_plan import VariantRequest, plan_variants

NAMES = ["s0", "s1"]
DIMS = {(2, 0): "s0", (2, 1): "s1"}
DEFAULT = [5, 7]


def plan(**kwargs: object) -> list[VariantRequest]:
    kwargs.setdefault("hints", None)
    kwargs.setdefault("sizes", None)
    return plan_variants(NAMES, DIMS, DEFAULT, **kwargs)  # type: ignore[arg-type]


def test_default_is_one_variant_at_the_caller_hints() -> None:
    assert plan() == [VariantRequest("hint", (5, 7))]


def test_list_hints_are_one_dimensional() -> None:
    assert [r.point for r in plan(hints=[16, 256])] == [(16, 16), (256, 256)]


def test_dict_hints_are_a_cartesian_product_by_name_or_dim() -> None:
    by_name = plan(hints={"s0": [1, 8], "s1": [16, 64, 256]})
    by_dim = plan(hints={(2, 0): [1, 8], (2, 1): [16, 64, 256]})
    assert by_name == by_dim
    assert len(by_name) == 6
    assert (8, 256) in [r.point for r in by_name]


def test_unmentioned_symbol_keeps_its_caller_hint() -> None:
    assert [r.point for r in plan(hints={"s1": [2, 4]})] == [(5, 2), (5, 4)]


def test_sizes_are_static_variants_after_hints() -> None:
    requests = plan(sizes=[3, {"s0": 1, "s1": 2}])
    assert requests == [
        VariantRequest("hint", (5, 7)),
        VariantRequest("static", (3, 3)),
        VariantRequest("static", (1, 2)),
    ]


def test_duplicates_are_dropped() -> None:
    assert len(plan(hints=[4, 4, 8])) == 2


def test_two_keys_of_one_symbol_may_give_it_the_same_hints() -> None:
    """Two dims Dynamo found equal (a tensor passed in two slots, each slot keyed with the
    same hints) name one symbol: the same hints twice are one request, not a conflict."""
    assert plan(hints={"s0": [4, 8], (2, 0): [4, 8]}) == plan(hints={"s0": [4, 8]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hints": [1, 2, 3], "max_variants": 2}, "3 variants, more than max_variants=2"),
        ({"hints": {"s0": list(range(6)), "s1": list(range(6))}}, "36 variants"),
        ({"hints": {"batch": [1]}}, "symbol 'batch'"),
        ({"hints": {(0, 0): [1]}}, r"\(input_index, dim\) \(0, 0\)"),
        ({"hints": {"s0": [1], (2, 0): [2]}}, "gives symbol s0 twice"),
        ({"hints": []}, "non-empty"),
        ({"hints": "16"}, "non-empty list"),
        ({"hints": [True]}, "must be an int"),
        ({"hints": {"s0": []}}, r"hints\['s0'\] must be a non-empty list"),
        ({"sizes": [{"s0": 3}]}, r"missing \['s1'\]"),
        ({"sizes": 3}, "sizes must be a list"),
        ({"max_variants": 0}, "max_variants must be a positive int"),
    ],
)
def test_bad_requests_are_clear_value_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message) as info:
        plan(**kwargs)
    assert isinstance(info.value, ValueError)


def test_a_static_graph_ignores_hints_and_sizes(caplog: pytest.LogCaptureFixture) -> None:
    """Dynamo hands a backend a static graph at size 1: the options meant for the dynamic
    graphs do not apply to it, and it compiles to its one variant."""
    with caplog.at_level(logging.DEBUG, logger="precompile.compile"):
        assert plan_variants([], {}, [], hints=[4], sizes=[8]) == [VariantRequest("hint", ())]
    assert "hints and sizes ignored" in caplog.text
    assert plan_variants([], {}, [], hints={"s0": [4]}, sizes=None) == [VariantRequest("hint", ())]
    with pytest.raises(InvalidOptionError, match="hints must be"):
        plan_variants([], {}, [], hints="16", sizes=None)


def test_a_hint_variant_held_to_one_size_is_named() -> None:
    """A hint variant whose guards hold a dim to one value serves that size alone: the
    compile warns (seen with grad enabled on causal attention: ``12 == s27``)."""
    import sympy

    from precompile._standalone import pinning_guards

    s, t = sympy.Symbol("s27", integer=True), sympy.Symbol("s3", integer=True)
    pinned = sympy.Eq(s, 12)
    assert pinning_guards([sympy.Ge(s, 2), sympy.Ne(s, 1), pinned, sympy.Eq(s, t)]) == [pinned]
    assert pinning_guards([sympy.Ge(s, 2), sympy.Lt(s * 2, 4096)]) == []
    assert pinning_guards([sympy.Eq(s, 1), sympy.Eq(t, 0)]) == []  # hint 0/1: by design
