"""A graph's variants compiled in worker processes beside the building one.

The variants of one graph are independent compiles (each from a fresh ShapeEnv, see
``_variant_compile``), each seconds to tens of seconds, most of it Python in one thread.
The building process compiles the first variant itself and hands the next ones to
worker processes (``python -m precompile._variant_workers``), started when the graph's
compile begins so that their start-up runs under its first compile.

A worker compiles under what the cache key reads: the compiler configs besides their
defaults, the environment (inherited), the attention switches and the global state
Dynamo's guard holds are sent, set, and checked equal to the building process's
(``codegen_config_digest``, ``trace_state``) before any compile. A worker that cannot
make them equal, fails or dies hands its variant back, and the building process
compiles it as it would have without workers: what a build produces never depends on
the workers, only how long it takes.

On a GPU the processes share the device: every kernel timing of autotuning holds one
file lock, so each process times its kernels alone, as one process would.

Both sides of the protocol live here. The graph and its state are one file in the
building process's private build dir, named on each worker's command line; then
length-prefixed pickles over the worker's stdin and stdout: one variant at a time, each
answered with ``("ok", CompiledVariant)`` or ``("back", reason)``.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass, replace
from typing import IO, Any

import sympy
import torch
from filelock import FileLock

from precompile.runtime import InvalidOptionError
from precompile.runtime.compiler_interface import build_dir, trace_state

from . import _torch_adapter as adapter
from . import _variant_compile as variant_compile
from ._attention_policy import attention_backends, sdpa_switches
from ._compiler_config import codegen_config_digest, compile_configs
from ._graph import GraphDescription
from ._variant_plan import VariantRequest

log = logging.getLogger("precompile.compile")

WORKERS_ENV = "PRECOMPILE_COMPILE_WORKERS"
_HEADER = struct.Struct("<Q")
_MAX_MESSAGE = 1 << 34  # 16 GiB: a length beyond it is a broken pipe, not a message


def worker_count(variants: int, device: str) -> int:
    """How many workers compile ``variants`` variants besides the building process's
    first: ``PRECOMPILE_COMPILE_WORKERS`` (a count, 0 for none, or ``auto``)."""
    raw = os.environ.get(WORKERS_ENV, "auto").strip().lower()
    if raw == "auto":
        wanted = _auto_count(device)
    else:
        try:
            wanted = int(raw)
        except ValueError:
            wanted = -1
        if wanted < 0:
            raise InvalidOptionError(
                f"{WORKERS_ENV} must be a count of worker processes (0 for none) or auto, "
                f"got {os.environ[WORKERS_ENV]!r}"
            )
    return max(0, min(wanted, variants - 1))


def _auto_count(device: str) -> int:
    """The default, where it was measured (docs/benchmarks.md, "Variants in worker
    processes"): a quarter of the cores on a CUDA build on a host of 16 or more (10-13%
    shorter on an H200 host of 16); none on CPU (slower on 2 cores) or on smaller hosts
    (not measured)."""
    cores = os.cpu_count() or 1
    return cores // 4 if device == "cuda" and cores >= 16 else 0


# -- the building process's side --------------------------------------------------------
@dataclass(frozen=True)
class _Context:
    """What every worker compiles from: the graph and the state it is compiled under."""

    gm: bytes
    to_compile: bytes | None  # the graph inductor is given, where it is not gm
    graph: GraphDescription
    options: Mapping[str, Any]
    configs: Mapping[str, Mapping[str, Any]]
    config_digest: str
    state: Mapping[str, Any]
    sdpa: Mapping[str, bool]
    cuda_device: int | None
    timing_lock: str | None


@dataclass(frozen=True)
class _Job:
    number: int
    request: VariantRequest
    point: Mapping[sympy.Symbol, int]


def _job_key(request: VariantRequest) -> tuple[str, tuple[int, ...]]:
    return request.kind, tuple(int(v) for v in request.point)


class _Worker:
    def __init__(self, context: str) -> None:
        env = dict(os.environ)
        env.pop("PRECOMPILE_BUILD_DIR", None)  # a worker builds in a directory of its own
        if env.get("TORCHINDUCTOR_CACHE_DIR") == build_dir():
            env.pop("TORCHINDUCTOR_CACHE_DIR")  # this process's build dir, swapped in
        self.process = subprocess.Popen(
            [sys.executable, "-m", "precompile._variant_workers", context],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.job: _Job | None = None
        self.started = 0.0

    def send(self, message: bytes) -> bool:
        stream = self.process.stdin
        try:
            assert stream is not None
            stream.write(_HEADER.pack(len(message)) + message)
            stream.flush()
            return True
        except (OSError, ValueError):
            return False

    def give(self, job: _Job) -> bool:
        self.job, self.started = job, time.perf_counter()
        return self.send(pickle.dumps(job))

    def answer(self) -> tuple[str, Any]:
        """The worker's answer to its job; ``("back", why)`` where it died."""
        assert self.process.stdout is not None
        message = _read_message(self.process.stdout)
        if message is None:
            code = self.process.poll()
            return "back", f"the worker process ended (exit status {code})"
        try:
            kind, value = pickle.loads(message)
        except Exception as exc:
            return "back", f"the worker's answer could not be read ({type(exc).__name__})"
        return str(kind), value

    def release(self) -> None:
        """An idle worker ends on its closed stdin; one still compiling (the build
        stopped early: an error, an interrupt) is killed, its variant unwanted."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            with suppress(OSError):
                self.process.stdin.close()
        if self.job is not None:
            self.process.kill()

    def reap(self) -> None:
        """Wait for the released worker to end (killed after 5 s of shutting down)."""
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class VariantWorkers:
    """Workers compiling the variants a graph's compile hands them, in queue order; the
    building process ``take``s each variant's result when it reaches it."""

    def __init__(self, context: bytes, jobs: Sequence[_Job], count: int) -> None:
        # A file the workers read once they have imported torch, instead of a pipe that
        # would hold this process until each had (seconds per worker on a GPU host).
        descriptor, self._context = tempfile.mkstemp(suffix=".context", dir=build_dir())
        with os.fdopen(descriptor, "wb") as file:
            file.write(context)
        self._pending = list(jobs)
        self._workers: list[_Worker] = []
        self._by_key: dict[tuple[str, tuple[int, ...]], _Worker] = {}
        for _ in range(count):
            worker = _Worker(self._context)
            self._workers.append(worker)
            self._next(worker)

    @classmethod
    def start(
        cls,
        gm: torch.fx.GraphModule,
        to_compile: torch.fx.GraphModule,
        graph: GraphDescription,
        options: Mapping[str, Any],
        queue: Sequence[VariantRequest],
    ) -> VariantWorkers | None:
        """Workers for every variant of ``queue`` but the first, where the settings and
        the state let them compile as this process would; None where they do not."""
        device = variant_compile.graph_device(graph)
        count = worker_count(len(queue), device)
        if count == 0:
            return None
        state = trace_state()
        unshippable = [k for k in ("torch_function_modes", "torch_dispatch_modes") if state[k]]
        if state.get("saved_tensors_hooks"):
            unshippable.append("saved_tensors_hooks")
        if unshippable:
            log.info("variants compiled in this process: %s active", ", ".join(unshippable))
            return None
        cuda = device == "cuda"
        try:
            context = pickle.dumps(
                _Context(
                    gm=adapter.graph_to_bytes(gm),
                    to_compile=None if to_compile is gm else adapter.graph_to_bytes(to_compile),
                    graph=replace(graph, caller_shape_env=None),
                    options=dict(options),
                    configs=compile_configs(),
                    config_digest=codegen_config_digest(),
                    state=state,
                    sdpa=sdpa_switches(),
                    cuda_device=torch.cuda.current_device() if cuda else None,
                    timing_lock=_timing_lock() if cuda else None,
                )
            )
        except Exception as exc:  # a graph or option torch's pickler cannot carry
            log.info(
                "variants compiled in this process: the graph or its options cannot be sent "
                "to a worker (%s: %s)", type(exc).__name__, variant_compile.first_line(exc, 200),
            )  # fmt: skip
            return None
        jobs = [
            _Job(number, request, dict(zip(graph.symbols, request.point, strict=True)))
            for number, request in enumerate(queue)
        ][1:]
        log.info("compiling %d variant(s) in %d worker process(es)", len(jobs), count)
        return cls(context, jobs, count)

    def _next(self, worker: _Worker) -> None:
        """The next variant not handed out to ``worker``; one it cannot take (it died)
        is this process's to compile when it reaches it."""
        worker.job = None
        if self._pending:
            job = self._pending.pop(0)
            if worker.give(job):
                self._by_key[_job_key(job.request)] = worker
        else:  # nothing left to hand out: it shuts down while the build goes on
            worker.release()

    def take(self, request: VariantRequest, number: int) -> variant_compile.CompiledVariant | None:
        """The variant a worker compiled for ``request``; None where this process is to
        compile it (no worker has it, or the worker handed it back: INFO says why)."""
        key = _job_key(request)
        worker = self._by_key.pop(key, None)
        if worker is None:  # not handed out yet: this process takes it
            self._pending = [j for j in self._pending if _job_key(j.request) != key]
            return None
        kind, value = worker.answer()
        took = time.perf_counter() - worker.started
        self._next(worker)
        if kind == "ok" and isinstance(value, variant_compile.CompiledVariant):
            log.info("variant %d compiled in a worker process in %.1f s", number, took)
            return value
        log.info("variant %d: the worker handed it back (%s); compiling it here", number, value)
        return None

    def close(self) -> None:
        """Release every worker; they are reaped by a thread of their own. An idle
        worker's interpreter shutdown took seconds (its inductor, its CUDA context): the
        build waited for each in turn before it went on."""
        for worker in self._workers:
            worker.release()
        threading.Thread(target=self._reap, name="precompile-worker-reaper", daemon=True).start()
        with suppress(OSError):
            os.unlink(self._context)

    def _reap(self) -> None:
        for worker in self._workers:
            worker.reap()


@contextmanager
def variant_workers(
    gm: torch.fx.GraphModule,
    to_compile: torch.fx.GraphModule,
    graph: GraphDescription,
    options: Mapping[str, Any],
    queue: Sequence[VariantRequest],
) -> Iterator[VariantWorkers | None]:
    """``VariantWorkers.start`` for the duration, this process's GPU timings under the
    workers' lock while they run; they are stopped at the end."""
    workers = VariantWorkers.start(gm, to_compile, graph, options, queue)
    if workers is None:
        yield None
        return
    try:
        with ExitStack() as stack:
            if variant_compile.graph_device(graph) == "cuda":
                stack.enter_context(_timings_under(_timing_lock()))
            yield workers
    finally:
        workers.close()


def _timing_lock() -> str:
    """The file whose lock every GPU timing of one build's processes holds."""
    return os.path.join(build_dir(), "gpu-timing.lock")


def _timings_under(path: str) -> AbstractContextManager[None]:
    lock = FileLock(path)
    return adapter.gpu_timings_under(lambda: lock)


def _read_message(stream: IO[bytes]) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) != _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    if length > _MAX_MESSAGE:
        return None
    data = stream.read(length)
    return data if len(data) == length else None


# -- the worker's side --------------------------------------------------------------------
def _set_state(context: _Context, stack: ExitStack) -> str | None:
    """This process put under the building process's compile state (its attention
    switches for as long as ``stack``); what still differs, or None where nothing does."""
    for name, values in context.configs.items():
        adapter.set_config_values(name, values)
    stack.enter_context(attention_backends(context.sdpa))
    state = context.state
    torch.set_grad_enabled(bool(state["grad_mode"]))
    torch.set_default_dtype(getattr(torch, str(state["default_dtype"]).replace("torch.", "")))
    enabled, warn_only = state["deterministic_algorithms"]
    torch.use_deterministic_algorithms(bool(enabled), warn_only=bool(warn_only))
    torch.set_float32_matmul_precision(str(state["float32_matmul_precision"]))
    # cuBLAS's reduced-precision reductions are not set here (the record holds torch's
    # internal encoding of them): where they differ the check below hands variants back
    for device, dtype in dict(state["autocast"]).items():
        torch.set_autocast_enabled(device, True)
        torch.set_autocast_dtype(device, getattr(torch, str(dtype).replace("torch.", "")))
    if context.cuda_device is not None:
        torch.cuda.set_device(context.cuda_device)
    now = trace_state()
    differing = sorted(k for k in state if k != "guard" and now.get(k) != state[k])
    guard = {k: v for k, v in dict(state["guard"]).items()}
    if {k: v for k, v in dict(now["guard"]).items()} != guard:
        differing.append("guard")
    if codegen_config_digest() != context.config_digest:
        differing.append("compiler configs")
    return ", ".join(differing) or None


def _prepared(context_path: str, stack: ExitStack) -> tuple[_Context, Any, Any, str | None]:
    """The context, its graphs, and why this worker cannot compile them (None where it
    can)."""
    with open(context_path, "rb") as file:
        context: _Context = pickle.loads(file.read(_MAX_MESSAGE))
    try:
        refused = _set_state(context, stack)
    except Exception as exc:  # a setting this torch does not take as recorded
        refused = f"{type(exc).__name__}: {variant_compile.first_line(exc, 200)}"
    if refused is not None:
        return context, None, None, f"this worker's compile state differs: {refused}"
    gm = adapter.graph_from_bytes(context.gm)
    to_compile = gm if context.to_compile is None else adapter.graph_from_bytes(context.to_compile)
    return context, gm, to_compile, None


def _answer(outbox: IO[bytes], answer: tuple[str, Any]) -> None:
    data = pickle.dumps(answer)
    outbox.write(_HEADER.pack(len(data)) + data)
    outbox.flush()


def _serve(context_path: str, inbox: IO[bytes], outbox: IO[bytes]) -> None:
    with ExitStack() as stack:
        try:
            context, gm, to_compile, refused = _prepared(context_path, stack)
        except Exception as exc:  # something of the caller's this process cannot unpickle
            reason = f"the graph could not be read here ({type(exc).__name__}: {exc!s:.200})"
            while _read_message(inbox) is not None:
                _answer(outbox, ("back", reason))
            return
        if context.timing_lock is not None:
            stack.enter_context(_timings_under(context.timing_lock))
        cpu = variant_compile.graph_device(context.graph) == "cpu"
        stack.enter_context(variant_compile.compiling_in_build_dir(cpu=cpu))
        while (message := _read_message(inbox)) is not None:
            job: _Job = pickle.loads(message)
            if refused is not None:
                _answer(outbox, ("back", refused))
                continue
            try:
                compiled = variant_compile.compile_under_policy(
                    gm, context.graph, job.point, job.request, context.options,
                    job.number, to_compile,
                )  # fmt: skip
            except Exception as exc:
                reason = f"{type(exc).__name__}: {variant_compile.first_line(exc, 300)}"
                _answer(outbox, ("back", reason))
            else:
                _answer(outbox, ("ok", compiled))


def main() -> None:
    """The worker: the context file its one argument names, then its protocol on the
    stdin and stdout it was started with; anything else it prints goes to stderr."""
    outbox = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.argv[1], sys.stdin.buffer, outbox)


if __name__ == "__main__":
    main()
