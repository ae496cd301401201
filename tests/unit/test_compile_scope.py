"""What the compile scope of a graph's variants changes in torch, for whom, and that it puts
everything back. No GPU and no compile here.

- GEMM template choices compile in autotuning's own threads: on torch 2.11 a choice handed
  to inductor's compile workers was compiled again, serially, when autotuning timed it
  (docs/benchmarks.md, Build time).
- A CPU graph's vector-ISA probe runs before the private build dir is entered, so its test
  programs stay in the user's inductor cache for the next process; its candidates are
  probed at once, each in a thread of its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from torch._inductor import select_algorithm
from torch._inductor.async_compile import AsyncCompile
from torch._subclasses.fake_tensor import FakeTensorMode

from precompile import _torch_adapter as compile_adapter
from precompile import _variant_compile
from precompile import _vec_isa_probe as vec_isa_probe


@pytest.fixture
def pool_ready(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Inductor's pool answers "ready" (no pool is started); each question is recorded."""
    asked: list[bool] = []

    def ready(cls: Any) -> bool:
        asked.append(True)
        return True

    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(ready))
    return asked


def test_choices_precompile_in_this_process_only_inside_autotuning(
    monkeypatch: pytest.MonkeyPatch, pool_ready: list[bool]
) -> None:
    seen: dict[str, bool] = {}
    other_thread: list[bool] = []

    def make_precompile_fn(self: Any, choices: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        seen[name] = AsyncCompile.use_process_pool()
        asked = AsyncCompile.use_process_pool
        worker = threading.Thread(target=lambda: other_thread.append(asked()))
        worker.start()
        worker.join()
        return None

    selector = select_algorithm.AlgorithmSelectorCache
    monkeypatch.setattr(selector, "make_precompile_fn", make_precompile_fn)
    before = (
        select_algorithm.AlgorithmSelectorCache.__dict__["make_precompile_fn"],
        AsyncCompile.__dict__["use_process_pool"],
    )
    with compile_adapter.precompiling_templates_in_threads():
        assert AsyncCompile.use_process_pool() is True  # a Triton kernel outside autotuning
        select_algorithm.AlgorithmSelectorCache.make_precompile_fn(object(), [], "mm", "key")
        assert AsyncCompile.use_process_pool() is True
    assert seen == {"mm": False}
    assert other_thread == [True]  # another thread's compile decides as inductor would
    after = (
        select_algorithm.AlgorithmSelectorCache.__dict__["make_precompile_fn"],
        AsyncCompile.__dict__["use_process_pool"],
    )
    assert after == before


def test_everything_is_put_back_when_the_compile_fails(pool_ready: list[bool]) -> None:
    before = (
        select_algorithm.AlgorithmSelectorCache.__dict__["make_precompile_fn"],
        AsyncCompile.__dict__["use_process_pool"],
    )
    with (
        pytest.raises(RuntimeError, match="inductor failed"),
        compile_adapter.precompiling_templates_in_threads(),
    ):
        raise RuntimeError("inductor failed")
    after = (
        select_algorithm.AlgorithmSelectorCache.__dict__["make_precompile_fn"],
        AsyncCompile.__dict__["use_process_pool"],
    )
    assert after == before


def test_every_variant_compile_enters_it(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[bool] = []

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        entered.append(True)
        yield

    monkeypatch.setattr(compile_adapter, "precompiling_templates_in_threads", recording)
    with _variant_compile._compile_context(FakeTensorMode(), size_oblivious=False):
        assert entered == [True]


def test_a_cpu_graph_probes_the_vector_isa_before_the_private_build_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from precompile.runtime import compiler_interface

    seen: list[str | None] = []
    monkeypatch.setattr(
        compile_adapter, "vec_isa", lambda: seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    )
    monkeypatch.setattr(compile_adapter, "vec_isa_candidates", lambda: [])
    monkeypatch.setattr(vec_isa_probe, "_started", False)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with _variant_compile.compiling_in_build_dir(cpu=True):
        inside = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        with _variant_compile.compiling_in_build_dir(cpu=True):  # nested: entered once
            pass
    assert inside == compiler_interface.build_dir() != before
    assert seen == [before]
    with _variant_compile.compiling_in_build_dir():  # a CUDA graph: no C++ kernels to build
        pass
    assert seen == [before]


def test_the_candidate_vector_isas_are_probed_at_once_outside_the_build_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor probes its candidate ISAs one after another (gcc and a loader each: 7.1 s
    of a 28 s build of the tiny Llama on 2 cores). Each is probed in a thread of its own,
    all at once (the barrier breaks unless the three wait on it together), once per
    process however often asked, with the caller's inductor cache dir, and joined before
    the build dir replaces it."""
    barrier = threading.Barrier(3, timeout=20)
    seen: list[tuple[str, str | None, bool]] = []

    class Candidate:
        def __init__(self, name: str) -> None:
            self.name = name

        def __bool__(self) -> bool:
            barrier.wait()
            here = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            seen.append((self.name, here, threading.current_thread() is threading.main_thread()))
            return True

    monkeypatch.setattr(
        compile_adapter, "vec_isa_candidates", lambda: [Candidate(n) for n in "abc"]
    )
    monkeypatch.setattr(compile_adapter, "vec_isa", lambda: ("a", ""))
    monkeypatch.setattr(vec_isa_probe, "_started", False)
    monkeypatch.setattr(vec_isa_probe, "_threads", [])
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    vec_isa_probe.start()  # as compile_model does before it traces
    with _variant_compile.compiling_in_build_dir(cpu=True):
        assert len(seen) == 3
    assert sorted(seen) == [(name, before, False) for name in "abc"]
    assert vec_isa_probe.vec_isa() == ("a", "") and len(seen) == 3


def test_a_torch_without_the_hooks_compiles_as_it_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose select_algorithm has no make_precompile_fn: nothing is patched, and
    the compile scope still opens and closes (its autotuning runs as torch's would)."""
    monkeypatch.delattr(select_algorithm.AlgorithmSelectorCache, "make_precompile_fn")
    before = AsyncCompile.__dict__["use_process_pool"]
    with compile_adapter.precompiling_templates_in_threads():
        assert AsyncCompile.__dict__["use_process_pool"] is before
    assert AsyncCompile.__dict__["use_process_pool"] is before


def test_a_gemm_choice_the_gpu_cannot_run_is_not_reported_as_an_error() -> None:
    """Inductor reports, at ERROR with a traceback, each GEMM template choice autotuning
    drops because it needs more shared memory than the GPU has: a successful build looked
    failed. Inside a compile those two reports go to our DEBUG log; any other failure
    and anything outside a compile is reported as inductor reports it."""
    import logging

    logger = logging.getLogger("torch._inductor.select_algorithm")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    shared = RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: "
                          "triton_mm Required: 262144 Hardware limit:232448")  # fmt: skip
    try:
        with compile_adapter.filtered_inductor_log(
            "select_algorithm", _variant_compile._loud_enough
        ):
            logger.error("Exception %s for benchmark choice %s", shared, "triton_mm_1")
            logger.error("Runtime error during autotuning: \n%s. \nIgnoring this choice.", shared)
            logger.error("Runtime error during autotuning: \n%s. \nIgnoring this choice.",
                         "an illegal memory access was encountered")  # fmt: skip
        logger.error("Exception %s for benchmark choice %s", shared, "triton_mm_2")
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 2, seen
    assert "illegal memory access" in seen[0] and "triton_mm_2" in seen[1]
