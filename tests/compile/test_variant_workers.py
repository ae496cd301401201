"""Variants compiled in worker processes (``precompile._variant_workers``): the same
code as one process compiles, eager's answers, and every way a worker can fail hands
its variant back to the building process instead of failing or changing the build."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import AttentionBlock, Captured, capture
from torch._inductor.custom_graph_pass import CustomGraphPass

import precompile
from precompile import _variant_workers
from precompile.runtime import InvalidOptionError

HINTS = [4, 64]
SIZES = [(1, 3), (2, 5), (3, 40), (1, 70)]


@pytest.fixture(scope="module")
def captured() -> Captured:
    torch.manual_seed(0)
    return capture(AttentionBlock().eval(), torch.randn(2, 6, 32))


def _compile(captured: Captured, workers: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(_variant_workers.WORKERS_ENV, workers)
    with torch.no_grad():
        return precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=HINTS, cache=False
        )


def _codes(artifact: Any) -> list[str]:
    return [variant.code for variant in artifact.manifest.variants]


def _check_eager(captured: Captured, artifact: Any) -> None:
    for batch, seq in SIZES:
        x = torch.randn(batch, seq, 32)
        with torch.no_grad():
            expected = captured.model(x)
            got = artifact(*captured.flat(x))
        got = got[0] if isinstance(got, (tuple, list)) else got
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def serial(captured: Captured) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as patch:
        yield _compile(captured, "0", patch)


def test_workers_compile_the_code_one_process_compiles(
    captured: Captured,
    serial: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="precompile.compile"):
        artifact = _compile(captured, "2", monkeypatch)
    assert caplog.text.count("compiled in a worker process") == len(HINTS) - 1
    assert _codes(artifact) == _codes(serial)
    _check_eager(captured, artifact)


def test_a_worker_that_cannot_take_the_callers_state_hands_its_variants_back(
    captured: Captured,
    serial: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # cuBLAS's reduced-precision setting is in the state a key reads, and not one a
    # worker sets: the worker refuses rather than compile under other state.
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = not before
    try:
        with caplog.at_level(logging.INFO, logger="precompile.compile"):
            artifact = _compile(captured, "2", monkeypatch)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
    assert "compiled in a worker process" not in caplog.text
    assert caplog.text.count("compile state differs: reduced_precision_reduction") == len(HINTS) - 1
    assert _codes(artifact) == _codes(serial)
    _check_eager(captured, artifact)


def test_a_worker_that_dies_hands_its_variant_back(
    captured: Captured,
    serial: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    give = _variant_workers._Worker.give

    def give_and_die(worker: Any, job: Any) -> bool:
        sent = give(worker, job)
        worker.process.kill()
        return sent

    monkeypatch.setattr(_variant_workers._Worker, "give", give_and_die)
    with caplog.at_level(logging.INFO, logger="precompile.compile"):
        artifact = _compile(captured, "1", monkeypatch)
    assert "the worker process ended" in caplog.text
    assert _codes(artifact) == _codes(serial)
    _check_eager(captured, artifact)


def test_the_build_goes_on_while_idle_workers_shut_down(tmp_path: Any) -> None:
    """A worker with nothing left to compile is released as its last answer is taken,
    and closing the workers waits for none of them: an idle worker's shutdown (its
    inductor, its CUDA context) took seconds, which the build waited out for each in
    turn (5.5 s of a 59 s GPU build). Each still ends, reaped by a thread."""
    import subprocess
    import sys
    import time

    slow_exit = "import sys, time; sys.stdin.buffer.read(); time.sleep(3)"

    def worker() -> Any:
        made = _variant_workers._Worker.__new__(_variant_workers._Worker)
        made.process = subprocess.Popen(
            [sys.executable, "-c", slow_exit], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        made.job, made.started = None, 0.0
        return made

    context = tmp_path / "workers.context"
    context.write_bytes(b"")
    workers = _variant_workers.VariantWorkers.__new__(_variant_workers.VariantWorkers)
    first, second = worker(), worker()
    workers._workers, workers._pending, workers._by_key = [first, second], [], {}
    workers._context = str(context)
    workers._next(first)  # its last answer taken, nothing pending: released at once
    assert first.process.stdin.closed and not second.process.stdin.closed
    started = time.perf_counter()
    workers.close()
    assert time.perf_counter() - started < 1.5
    assert second.process.stdin.closed and not context.exists()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
        first.process.stdout.closed and second.process.stdout.closed
    ):
        time.sleep(0.05)
    assert first.process.returncode == 0 and second.process.returncode == 0
    assert first.process.stdout.closed and second.process.stdout.closed


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_a_bad_worker_count_is_named(
    captured: Captured, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    with pytest.raises(InvalidOptionError, match="PRECOMPILE_COMPILE_WORKERS"):
        _compile(captured, value, monkeypatch)


class _KeepGraph(CustomGraphPass):
    """A post-grad pass that changes nothing, defined where no worker can import it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return "keep-graph"


def test_a_worker_that_cannot_read_the_callers_options_hands_its_variants_back(
    captured: Captured, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_variant_workers.WORKERS_ENV, "1")
    options = {"config_patches": {"post_grad_custom_post_pass": _KeepGraph()}}
    with caplog.at_level(logging.INFO, logger="precompile.compile"), torch.no_grad():
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=HINTS, cache=False, options=options
        )
    assert "the graph could not be read here (ModuleNotFoundError" in caplog.text
    assert "compiled in a worker process" not in caplog.text
    _check_eager(captured, artifact)


@pytest.mark.parametrize(
    ("value", "cores", "device", "expected"),
    [
        ("auto", 16, "cuda", 2),  # a quarter of 16, but a 3-variant graph hands out 2
        ("auto", 8, "cuda", 0),  # measured on 16 cores only
        ("auto", 64, "cpu", 0),
        ("3", 2, "cpu", 2),
        ("0", 64, "cuda", 0),
    ],
)
def test_the_worker_count(
    monkeypatch: pytest.MonkeyPatch, value: str, cores: int, device: str, expected: int
) -> None:
    monkeypatch.setenv(_variant_workers.WORKERS_ENV, value)
    monkeypatch.setattr(_variant_workers.os, "cpu_count", lambda: cores)
    assert _variant_workers.worker_count(3, device) == expected


def test_the_code_digest_ignores_what_names_the_compiling_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On CUDA inductor names each Triton kernel's file in the compiling process's own
    # cache dir: the same code compiled by a worker must digest the same.
    from precompile import _compiled_payload, _torch_adapter

    def code(process: str, number: int, body: str = "buf0 = x + 1") -> str:
        return (
            f"# AOT ID: ['{number}_inference']\n"
            f"# kernel path: /tmp/precompile-build-{process}/wg/cwgv.py\n{body}\n"
        )

    sources = {b"a": [code("502-kc4", 3)], b"b": [code("978-ulq", 0)],
               b"c": [code("502-kc4", 3, "buf0 = x + 2")]}  # fmt: skip
    monkeypatch.setattr(_torch_adapter, "wrapper_sources", lambda payload: sources[payload])
    digest = _compiled_payload.variant_code_digest
    assert digest(b"a") == digest(b"b")
    assert digest(b"a") != digest(b"c")
