"""Guard strings from artifacts are compiled only after an allowlist check."""

from __future__ import annotations

import pytest

from precompile import CorruptArtifactError
from precompile.runtime._expressions import compile_function


def test_guard_expressions_evaluate() -> None:
    fn = compile_function(
        [
            "s0 == 1",
            "(s0 % 16) == 0",
            "s1*(s0 // 4) <= 2147483647",
            "max(s0, s1) > 3",
            "s0 > 2 and s1 < 5",
            "s0*s1*s1 < 100",
        ],
        ["s0", "s1"],
    )
    assert fn(16, 2) == (False, True, True, True, True, True)
    assert fn(1, 9)[0] is True


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "s0.__class__",
        "open('x')",
        "[s0 for s0 in (1,)]",
        "lambda: 1",
        "s0 ** s0",
        "2 ** 100000",
        "'text' == s0",
        "s9 == 1",
        "s0 ==",
    ],
)
def test_forbidden_or_broken_expressions_are_corrupt(text: str) -> None:
    with pytest.raises(CorruptArtifactError):
        compile_function([text], ["s0"])
