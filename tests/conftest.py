"""Shared models and session-scoped compiled artifacts.

Compiling is the slow part (gcc on CPU), so each graph is compiled once per session
and every test reads the same artifacts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_UNDER_PYTEST = "pytest" in sys.modules  # subprocess scripts import this file too

import pytest  # noqa: E402
import torch  # noqa: E402

# The test session this process belongs to: a pytest-xdist worker's own (``gw0``, ...),
# else the one session of a plain run.
_SESSION = os.environ.get("PYTEST_XDIST_WORKER", "main")
if _UNDER_PYTEST and os.environ.get("PRECOMPILE_TEST_SESSION") != _SESSION:
    # Tests never touch the user's cache: one private cache per test session (per xdist
    # worker too: tests count the compiles their session makes). Subprocess scripts
    # inherit it (or get the one their test passes), even those that import pytest
    # through a test module: the marker says which session made it.
    os.environ["PRECOMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="precompile-test-cache-")
    os.environ["PRECOMPILE_TEST_SESSION"] = _SESSION
    atexit.register(shutil.rmtree, os.environ["PRECOMPILE_CACHE_DIR"], ignore_errors=True)
if _UNDER_PYTEST and "PRECOMPILE_TEST_BUILD_DIR" not in os.environ:
    # One build dir for the whole run (pytest's process, its xdist workers and every
    # subprocess inherit it): a kernel one process built, another finds instead of
    # building it again with g++ (a second tiny Llama build: 29 -> 14 s). It is the
    # documented $PRECOMPILE_BUILD_DIR, private to this user; tests of the private
    # per-process dir set it empty.
    os.environ["PRECOMPILE_TEST_BUILD_DIR"] = tempfile.mkdtemp(prefix="precompile-test-build-")
    os.environ["PRECOMPILE_BUILD_DIR"] = os.environ["PRECOMPILE_TEST_BUILD_DIR"]
    atexit.register(shutil.rmtree, os.environ["PRECOMPILE_TEST_BUILD_DIR"], ignore_errors=True)

import precompile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from demo import MLP  # noqa: E402  (the demo's model doubles as the test MLP)

# Folders by what their files cost, dearest first: pytest-xdist hands each worker the
# next file in collection order (``--dist loadfile``), so the long files start first and
# the short ones fill in at the end, instead of one worker running a long file alone.
_COST_ORDER = ("models", "fleet", "compile", "gpu", "unit")


def _cost_rank(item: pytest.Item) -> int:
    parts = item.path.parts
    folder = parts[parts.index("tests") + 1] if "tests" in parts[:-1] else ""
    return _COST_ORDER.index(folder) if folder in _COST_ORDER else len(_COST_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_cost_rank)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class AttentionBlock(torch.nn.Module):
    """Causal self-attention over x: [batch, seq, width]; batch and seq are dynamic."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = (batch, seq, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (width // self.heads) ** 0.5
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width)
        return x + self.out(attended)


@dataclass
class Captured:
    """A Dynamo graph plus how to build its flat inputs from the model's user inputs."""

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    model: torch.nn.Module
    user_positions: dict[int, int]  # placeholder index -> user input position

    def flat(self, *user_inputs: torch.Tensor) -> list[Any]:
        args: list[Any] = []
        for index, example in enumerate(self.example_inputs):
            if index in self.user_positions:
                args.append(user_inputs[self.user_positions[index]])
            elif isinstance(example, torch.SymInt):
                args.append(None)
            else:
                args.append(example)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for index, example in enumerate(self.example_inputs):
            if not isinstance(example, torch.SymInt):
                continue
            args[index] = self._int_value(example, placeholders, args)
        return args

    @staticmethod
    def _int_value(example: torch.SymInt, placeholders: list[Any], args: list[Any]) -> int:
        target = example.node.expr
        for node, arg in zip(placeholders, args, strict=True):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and isinstance(arg, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == target:
                        return int(arg.shape[dim])
        raise AssertionError(f"no tensor dim carries {target}")


def capture(model: torch.nn.Module, *user_inputs: torch.Tensor) -> Captured:
    """Trace ``model`` with Dynamo (all dims dynamic) and keep the graph it hands a backend."""
    # dynamic=True would also turn float attributes (LayerNorm eps) into graph inputs.
    with torch._dynamo.config.patch(specialize_float=True):
        gm, inputs = precompile.capture_graph(model, *user_inputs, dynamic=True)
    positions = {}
    for index, example in enumerate(inputs):
        for position, user in enumerate(user_inputs):
            if example is user:
                positions[index] = position
    return Captured(gm, inputs, model, positions)


@dataclass
class Compiled:
    captured: Captured
    artifact: precompile.CompiledArtifact


MLP_HINTS = [1, 16, 256]
MLP_SIZES = [3]


@pytest.fixture(scope="session")
def mlp() -> Compiled:
    torch.manual_seed(0)
    model = MLP(width=32, hidden=64).eval()
    captured = capture(model, torch.randn(5, 32))
    with torch.no_grad():
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=MLP_HINTS, sizes=MLP_SIZES
        )
    return Compiled(captured, artifact)


@pytest.fixture(scope="session")
def saved(mlp: Compiled, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("saved")
    paths = {"binary": str(root / "mlp.pt2c"), "unpacked": str(root / "mlp_dir")}
    for fmt, path in paths.items():
        mlp.artifact.save(path=path, format=fmt)  # type: ignore[arg-type]
    return paths


ATTN_HINTS = {"batch": [1, 8], "seq": [1, 64]}  # 4 variants: n-d at the least cost


@pytest.fixture(scope="session")
def attention() -> Compiled:
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    captured = capture(model, torch.randn(3, 5, 32))
    placeholder = next(i for i, p in captured.user_positions.items() if p == 0)
    hints = {(placeholder, 0): ATTN_HINTS["batch"], (placeholder, 1): ATTN_HINTS["seq"]}
    with torch.no_grad():
        artifact = precompile.standalone_compile(captured.gm, captured.example_inputs, hints=hints)
    return Compiled(captured, artifact)


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    """Run ``code`` in a fresh interpreter (a clean process, as a server would start)."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def assert_close(actual: Sequence[torch.Tensor] | torch.Tensor, expected: torch.Tensor) -> None:
    value = actual[0] if isinstance(actual, (list, tuple)) else actual
    torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-4)


# A process of a fleet: counts its compiles, captures the test MLP, then waits until all
# ``sys.argv[2]`` processes are ready (files in the directory ``sys.argv[1]``) so they
# miss the cache together. The body follows, with its own arguments in ``sys.argv[3:]``.
FLEET_PREAMBLE = """
import json, os, sys, time
sys.path.insert(0, "tests")
import torch, precompile
from precompile import _variant_compile
from precompile.cache import ArtifactCache
from conftest import MLP, capture
compiles = []
original = _variant_compile.compile_variant
def counting(*a, **k):
    compiles.append(1)
    return original(*a, **k)
_variant_compile.compile_variant = counting
torch.manual_seed(0)
model = MLP(width=32, hidden=64).eval()
captured = capture(model, torch.randn(6, 32))
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
while len(os.listdir(sys.argv[1])) < int(sys.argv[2]):
    time.sleep(0.01)
"""


def run_fleet(
    body: str, arguments: Sequence[Sequence[str]], barrier: str, env: dict[str, str] | None = None
) -> list[str]:
    """Start one process per argument list (``FLEET_PREAMBLE`` + ``body``), all at once;
    return their outputs once every one exited 0."""
    os.makedirs(barrier)
    script = FLEET_PREAMBLE + textwrap.dedent(body)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, barrier, str(len(arguments)), *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in arguments
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return [out for out, _ in outputs]
