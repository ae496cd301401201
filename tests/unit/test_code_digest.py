"""A model class or helper defined where no file is (``python -c``, a notebook cell) is
keyed by its code's digest: the same code must give the same digest in every process
(a frozenset constant's order follows the process's string hashes), and another code
another digest."""

from __future__ import annotations

import os
import subprocess
import sys

from precompile.runtime._model_identity import code_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = """
import sys
sys.path.insert(0, {root!r})
from precompile.runtime._model_identity import code_digest
def kind(x):
    return "vowel" if x in {{"a", "e", "i", "o", "u"}} else (lambda y: y * 2.5)(x)
print(code_digest(kind.__code__))
"""


def test_the_same_code_has_one_digest_across_hash_seeds() -> None:
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM.format(root=ROOT)],
            capture_output=True, text=True, env=env, timeout=120, check=True,
        )  # fmt: skip
        digests.add(done.stdout.strip())
    assert len(digests) == 1, digests


def test_another_constant_or_operation_is_another_digest() -> None:
    def twice(x: float) -> float:
        return x * 2

    def thrice(x: float) -> float:
        return x * 3

    def plus_two(x: float) -> float:
        return x + 2

    digests = {code_digest(f.__code__) for f in (twice, thrice, plus_two)}
    assert len(digests) == 3
