"""``precompile.errors``: every error class, the facts each carries, and that those facts
survive pickling (errors cross processes in the tensor-parallel and subprocess paths)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import precompile.cache
import precompile.runtime
from precompile import errors

# class -> the attributes its constructor takes, with a value each
FACTS: dict[str, dict[str, Any]] = {
    "NoVariantError": {"sizes": {"s0": 101}, "candidates": ("variant 0",)},
    "InputMismatchError": {"input_name": "x", "expected": "torch.float32", "got": "torch.int64"},
    "IndexOutOfRangeError": {"input_name": "ids", "expected": range(0, 10), "got": 12},
    "ArtifactNotFoundError": {"key": "a" * 64},
    "CorruptArtifactError": {"path": "/tmp/model.pt2c"},
    "PayloadLimitError": {"path": "/tmp/model.pt2c"},
}


@pytest.mark.parametrize("name", errors.__all__)
def test_each_error_pickles_with_its_message_class_and_facts(name: str) -> None:
    cls = getattr(errors, name)
    facts = FACTS.get(name, {})
    error = cls("what went wrong", **facts)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == "what went wrong" and back.args == error.args
    for attribute, value in facts.items():
        assert getattr(back, attribute) == value, attribute
    # without the facts, as every raise site wrote it before: None each, pickled too
    plain = pickle.loads(pickle.dumps(cls("plain")))
    assert str(plain) == "plain"
    for attribute in facts:
        assert getattr(plain, attribute) is None, attribute


def test_errors_are_the_classes_the_faces_serve() -> None:
    """One class object each, wherever imported from; the stdlib bases stay."""
    for name in errors.__all__:
        assert getattr(precompile, name) is getattr(errors, name)
        assert getattr(precompile.runtime, name) is getattr(errors, name)
        assert issubclass(getattr(errors, name), errors.PrecompileError)
    for name in precompile.cache.__all__:
        if name.endswith("Error"):
            assert getattr(precompile.cache, name) is getattr(errors, name)
    assert issubclass(errors.IndexOutOfRangeError, (errors.InputMismatchError, IndexError))
    assert issubclass(errors.NoVariantError, ValueError)
    assert issubclass(errors.ArtifactNotFoundError, FileNotFoundError)
    assert issubclass(errors.CorruptArtifactError, ValueError)


def test_restated_refusal_keeps_class_and_facts() -> None:
    error = errors.IndexOutOfRangeError("input 0 holds 12", input_name="input 0", got=12)
    said = error.restated("input 0 (ids) holds 12", input_name="ids")
    assert type(said) is errors.IndexOutOfRangeError and str(said) == "input 0 (ids) holds 12"
    assert (said.input_name, said.expected, said.got) == ("ids", None, 12)


def test_a_refused_size_says_its_sizes_and_candidates() -> None:
    """A real dispatch (no compile: ``synthetic_helpers``' one-variant artifact) refuses a size
    its guard excludes, with the sizes and each variant's failed guards, pickled too."""
    from synthetic_helpers import make_artifact

    art = make_artifact([("hint", {"s0": 8}, ("s0 <= 100",))])
    with pytest.raises(errors.NoVariantError) as info:
        art(torch.randn(101, 4))
    error = pickle.loads(pickle.dumps(info.value))
    assert error.sizes == {"s0": 101}
    (candidate,) = error.candidates
    assert (candidate.variant, candidate.failed_guards) == (0, ("s0 <= 100",))
    assert str(error) == str(info.value)


def test_a_refused_input_says_which_and_what(mlp: Any) -> None:
    """The session MLP (compiled for float32 [batch, 32]) refuses a float64 input and a
    wrong width, naming the input and what it wanted and got."""
    good = mlp.captured.flat(torch.randn(4, 32))
    (index,) = mlp.captured.user_positions
    names = [spec.name for spec in mlp.artifact.manifest.inputs]
    bad = list(good)
    bad[index] = good[index].double()
    with pytest.raises(errors.InputMismatchError) as info:
        mlp.artifact(*bad)
    error = pickle.loads(pickle.dumps(info.value))
    assert (error.input_name, error.expected, error.got) == (names[index], "float32", "float64")
    bad[index] = torch.randn(4, 32, 2)
    with pytest.raises(errors.InputMismatchError) as info:
        mlp.artifact(*bad)
    assert info.value.input_name == names[index] and info.value.got == (4, 32, 2)
    assert len(info.value.expected) == 2 and info.value.expected[1] == 32
    with pytest.raises(errors.InputMismatchError) as info:
        mlp.artifact(*good[:-1])
    assert (info.value.input_name, info.value.expected, info.value.got) == (
        None,
        len(good),
        len(good) - 1,
    )


def test_a_missing_tag_or_key_says_it(tmp_path: Path) -> None:
    store = precompile.cache.ArtifactCache(str(tmp_path))
    with pytest.raises(errors.ArtifactNotFoundError) as info:
        precompile.runtime.CompiledArtifact.load(tag="model", cache=store)
    assert pickle.loads(pickle.dumps(info.value)).key == "model"
    with pytest.raises(errors.ArtifactNotFoundError) as info:
        precompile.runtime.CompiledArtifact.load(key="0" * 64, cache=store)
    assert info.value.key == "0" * 64


def test_a_truncated_file_says_its_path(saved: dict[str, str], tmp_path: Path) -> None:
    data = Path(saved["binary"]).read_bytes()
    for label, content in {"in payloads": data[:-100], "in header": data[:30]}.items():
        path = tmp_path / "truncated.pt2c"
        path.write_bytes(content)
        with pytest.raises(errors.CorruptArtifactError) as info:
            precompile.runtime.CompiledArtifact.load(path=path)
        assert pickle.loads(pickle.dumps(info.value)).path == str(path), label


def test_a_missing_file_is_one_of_ours_and_still_a_file_not_found(tmp_path: Any) -> None:
    """A client trial: loading a path that is not there raised a plain FileNotFoundError,
    which ``except PrecompileError`` missed."""
    absent = str(tmp_path / "absent.pt2c")
    for load in (
        lambda: precompile.CompiledArtifact.load(path=absent),
        lambda: precompile.load_model(torch.nn.Linear(2, 2), path=absent),
    ):
        with pytest.raises(errors.ArtifactNotFoundError, match=r"absent\.pt2c") as info:
            load()
        assert isinstance(info.value, FileNotFoundError)


def test_to_another_device_refuses_what_it_cannot_move(mlp: Any) -> None:
    """``to()`` moves a CUDA artifact's lean variants to another device index; anything
    else is refused by name, before any variant loads."""
    art = mlp.artifact
    assert art.to("cpu") is art and art.to(torch.device("cpu")) is art  # already there
    with pytest.raises(errors.InvalidOptionError, match="CUDA device with an index"):
        art.to("cuda")
    with pytest.raises(errors.IncompatibleArtifactError, match=r"not compiled for one CUDA"):
        art.to("cuda:1")  # a CPU artifact
    with pytest.raises(errors.IncompatibleArtifactError, match=r"not compiled for one CUDA"):
        art.to(0)
    for odd in (-1, True, "cuda:x", None, 1.5, torch.device("meta")):
        with pytest.raises(errors.InvalidOptionError, match="CUDA device with an index"):
            art.to(odd)
