"""``precompile.errors``: every error class, the facts each carries, and that those facts
survive pickling (errors cross processes in the tensor-parallel and subprocess paths)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

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
