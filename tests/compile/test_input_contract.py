"""The input contract on hostile inputs: views, expands, neg/conj bits, sparse, subclasses,
grad mode, inputs the graph writes or returns views of. Each case runs on the first call
of an artifact (the Python check) and after a good call (the C++ guard), in this process
and in a fresh one."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import Captured, capture, run_python
from contract_cases_helpers import (
    Accumulate,
    Projection,
    Rows,
    check_accumulate,
    check_projection,
    check_rows,
)

import precompile

# The dangerous configuration: without inductor's own size asserts, a layout the code was
# not compiled for gives wrong numbers or reads out of bounds unless the contract stops it.
UNCHECKED = {"config_patches": {"size_asserts": False}}


def _compile(model: torch.nn.Module, *inputs: torch.Tensor) -> tuple[Captured, Any]:
    captured = capture(model, *inputs)
    with torch.no_grad():
        art = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[1, 64], options=UNCHECKED
        )
    return captured, art


@pytest.fixture(scope="module")
def projection() -> tuple[Projection, Captured, Any]:
    torch.manual_seed(0)
    model = Projection().eval()
    captured, art = _compile(model, torch.randn(6, 8))
    return model, captured, art


@pytest.mark.parametrize("path", ["first call (Python check)", "after a good call (C++ guard)"])
def test_views_and_odd_inputs_compute_eager_results_or_are_refused(
    projection: tuple[Projection, Captured, Any], path: str, tmp_path: Any
) -> None:
    model, captured, art = projection
    target = os.path.join(str(tmp_path), "projection.pt2c")
    art.save(path=target)
    fresh = precompile.CompiledArtifact.load(path=target)
    if path.startswith("after"):
        with torch.no_grad():
            fresh(*captured.flat(torch.randn(3, 8)))
        assert "GUARD" in fresh._contract.read_key.__code__.co_names
    else:
        assert fresh._contract.read_key == fresh._contract._first_read
    seen = check_projection(fresh, model, captured.flat)
    assert len(seen) == 14, seen


def test_views_in_a_fresh_process(
    projection: tuple[Projection, Captured, Any], tmp_path: Any
) -> None:
    _, _, art = projection
    target = os.path.join(str(tmp_path), "projection.pt2c")
    art.save(path=target)
    out = run_python(
        f"""
import sys, torch, precompile
sys.path.insert(0, "tests")
from conftest import capture
from contract_cases_helpers import Projection, check_projection
torch.manual_seed(0)
model = Projection().eval()
captured = capture(model, torch.randn(6, 8))
art = precompile.CompiledArtifact.load(path={target!r})
print("cases", len(check_projection(art, model, captured.flat)))
"""
    )
    assert "cases 14" in out, out


def test_a_conjugate_view_is_resolved() -> None:
    """The compiled kernel reads the stored (unconjugated) values through view_as_real;
    a conj view must be resolved first (eager refuses to view_as_real it at all)."""

    class RealParts(torch.nn.Module):
        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return torch.view_as_real(z).sum(-1) * 2

    z = torch.randn(5, 4, dtype=torch.complex64)
    captured, art = _compile(RealParts(), z)
    w = torch.randn(6, 4, dtype=torch.complex64)
    for first in (w.conj(), w, w.conj()):  # Python check, then guard, then guard says no
        expected = RealParts()(first.resolve_conj())
        torch.testing.assert_close(art(*captured.flat(first))[0], expected)


def test_an_input_the_graph_writes_is_copied_back_or_refused() -> None:
    captured, art = _compile(Accumulate(), torch.zeros(8), torch.randn(5, 8))
    written = [
        i for i, spec in enumerate(art.manifest.inputs) if getattr(spec, "mutation", "") == "data"
    ]
    assert len(written) == 1
    seen = check_accumulate(art, captured.flat)
    assert seen == [
        "strided total written back",
        "contiguous total",
        "expanded total",
        "total aliasing x",
    ]
    seen = check_accumulate(art, captured.flat)  # again, with the C++ guard installed
    assert "GUARD" in art._contract.read_key.__code__.co_names
    assert len(seen) == 4


def test_an_input_an_output_views_is_never_copied() -> None:
    captured, art = _compile(Rows(), torch.randn(5, 8))
    assert any(getattr(spec, "aliased", False) for spec in art.manifest.inputs)
    assert check_rows(art, captured.flat) == ["view of the caller's tensor", "transposed refused"]


def test_explain_judges_sizes_not_grad_mode(projection: tuple[Projection, Captured, Any]) -> None:
    """explain() answers for the inputs; whether grad is on is the call's business."""
    _, captured, art = projection
    needs_grad = torch.randn(7, 8, requires_grad=True)
    assert art.sizes_of(*captured.flat(needs_grad)) == {art.symbols[0].name: 7}
    with pytest.raises(precompile.InputMismatchError, match="dtype float32"):
        art.explain(*captured.flat(needs_grad.detach().double()))


class _Lookup(torch.nn.Module):
    """Token ids through an embedding table, then a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(50, 8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.table(ids))


def test_index_inputs_outside_their_table_are_refused_in_this_and_a_fresh_process(
    tmp_path: Any,
) -> None:
    """An input used as an embedding's indices is recorded with the table's rows; a call
    holding a value outside [0, rows) raises IndexOutOfRangeError (an IndexError, as
    eager raises) naming the input and the value, before any compiled kernel reads it,
    after a good call too and in a fresh process loading the saved artifact."""
    model = _Lookup().eval()
    ids = torch.randint(0, 50, (2, 6))
    captured, art = _compile(model, ids)
    (index,) = [i for i, user in captured.user_positions.items() if user == 0]
    assert art.manifest.inputs[index].index_rows == 50
    with torch.no_grad():
        torch.testing.assert_close(art(*captured.flat(ids))[0], model(ids))
        for bad, shown in ((torch.tensor([[3, 50]]), "50"), (torch.tensor([[-2, 4, 5]]), "-2")):
            with pytest.raises(IndexError, match=f"input {index} \\(L_ids_\\) holds {shown}, "
                                                 "outside the embedding's 50 rows"):  # fmt: skip
                art(*captured.flat(bad))
    path, inputs = str(tmp_path / "lookup.pt2c"), str(tmp_path / "inputs.pt")
    art.save(path=path)
    torch.save(captured.flat(torch.tensor([[7, 999]])), inputs)
    out = run_python(
        "import torch, precompile\n"
        f"art = precompile.CompiledArtifact.load(path={path!r})\n"
        f"print(art.manifest.inputs[{index}].index_rows)\n"
        "try:\n"
        "    with torch.no_grad():\n"
        f"        art(*torch.load({inputs!r}))\n"
        "except precompile.IndexOutOfRangeError as exc:\n"
        "    print(exc)\n"
    )
    assert out.splitlines()[0] == "50", out
    assert f"input {index} (L_ids_) holds 999" in out, out


def test_inputs_have_names_in_the_manifest_errors_and_art_inputs(tmp_path: Any) -> None:
    """Each flat input's origin in the caller's code is recorded: ``art.inputs`` lists
    them in call order, errors say them beside the index, a wrong count lists them, and
    a saved artifact keeps them (a name that is not short printable text is refused)."""
    import json

    model = _Lookup().eval()
    captured, art = _compile(model, torch.randint(0, 50, (2, 6)))
    names = art.inputs
    assert len(names) == len(captured.example_inputs)
    assert "L_ids_" in names and any("table" in n for n in names), names
    index = names.index("L_ids_")
    args = captured.flat(torch.randint(0, 50, (2, 6)))
    args[index] = args[index].float()
    with torch.no_grad():
        with pytest.raises(precompile.InputMismatchError,
                           match=rf"input {index} \(L_ids_\) should have dtype int64"):  # fmt: skip
            art(*args)
        with pytest.raises(precompile.InputMismatchError, match=r"the inputs are 0: .*L_ids_"):
            art(*args[:-1])
    path = str(tmp_path / "lookup")
    art.save(path=path, format="unpacked")
    assert precompile.CompiledArtifact.load(path=path, format="unpacked").inputs == names
    manifest = os.path.join(path, "manifest.json")
    with open(manifest, encoding="utf-8") as handle:
        document = json.load(handle)
    document["inputs"][index]["name"] = "\x1b[31mred"
    with open(manifest, "w", encoding="utf-8") as handle:
        json.dump(document, handle)
    with pytest.raises(precompile.CorruptArtifactError, match="name"):
        precompile.CompiledArtifact.load(path=path, format="unpacked")


def test_an_expanded_example_refuses_inputs_whose_rows_differ() -> None:
    """Compiled from an expand()ed example (rows of stride 0), the code may read one row
    for all: a call whose rows own their elements is refused by name, never copied into
    that layout (torch refuses the copy; a copy that kept one row would be wrong)."""
    torch.manual_seed(0)
    model = Projection().eval()
    captured, art = _compile(model, torch.randn(1, 8).expand(6, 8))
    assert any(getattr(spec, "stride", None) == (0, 1) for spec in art.manifest.inputs)
    with torch.no_grad():
        with pytest.raises(precompile.InputMismatchError, match=r"strides \(8, 1\).*overlap"):
            art(*captured.flat(torch.randn(6, 8)))
        expanded = torch.randn(1, 8).expand(6, 8)
        torch.testing.assert_close(art(*captured.flat(expanded))[0], model(expanded))
