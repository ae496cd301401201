"""CUDA graphs per size: an executor that captures a variant once per size tuple and
replays it, so a launch-bound model costs one graph launch per call instead of one
launch per kernel. Capture runs kernels that are already compiled; nothing compiles.

Per captured size, inputs whose address changes between calls (activations) get a static
buffer they are copied into before each replay; parameters and buffers (what Dynamo
marked static, and any ``nn.Parameter``) are used in place and their addresses checked
on every replay (a moved one means the graph is dropped and captured again). All graphs
of an artifact share one memory pool. Outputs are copied out of the pool by default, so
nothing the caller holds is overwritten by a later replay; ``copy_outputs=False``
returns the pool's tensors, valid until the next call at that size.

Padding (opt-in, for symbols the caller declares safe to pad, as vLLM pads batch dims): a
call at a size between captured sizes replays the next larger captured graph on inputs
zero-padded at the end of those dims, and its outputs are sliced back. Before padding is
trusted, one padded run is checked against an unpadded one.

Graphs that write their inputs (a KV cache, a buffer updated in place): an input the
graph writes is captured in place, marked static by Dynamo or not (transformers marks a
StaticCache's tensors, but not those first filled inside another torch.compile trace),
so a replay writes the caller's own storage; its address is checked before every
replay with the parameters' (one C++ compare of the recorded pointers), and a moved one
(another cache object) drops that graph: the call runs plainly and the size is captured
again. Such a size is captured at its second call, and the run before capture is that
call itself (a warm-up run would write the cache twice). A graph keeps no reference
to the tensors it uses in place.

What cannot be captured (CPU inputs, an input the graph resizes, a synchronizing op, a
capture error) runs plainly, logged once with the reason: correctness first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _torch_adapter as adapter
from ._errors import InvalidOptionError
from ._graph_release import register
from ._manifest import IntInput, Manifest, TensorInput

log = logging.getLogger("precompile.runtime")
Sizes = tuple[int, ...]


@dataclass(frozen=True)
class CudaGraphs:
    """How an artifact uses CUDA graphs (``cudagraphs=`` on compile, load and backend).

    ``capture_sizes``: size tuples (ints for one symbol, or ``{symbol: size}``) captured
    at warm-up instead of on first call. ``max_graphs``: at most this many graphs are kept;
    other sizes run plainly. ``pad``: symbols safe to pad (rows independent, or causal
    with padding at the end): a size between captured ones replays the next larger
    graph on zero-padded inputs. ``copy_outputs``: copy outputs out of the graph pool
    (default; else they are overwritten by the next call at that size)."""

    capture_sizes: tuple[Any, ...] = ()
    max_graphs: int = 64
    pad: tuple[str, ...] | bool = ()  # True: every symbol (one-symbol graphs, say)
    copy_outputs: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "capture_sizes": [list(s) if isinstance(s, tuple) else s for s in self.capture_sizes],
            "max_graphs": self.max_graphs,
            "pad": self.pad if isinstance(self.pad, bool) else list(self.pad),
            "copy_outputs": self.copy_outputs,
        }


CudaGraphsOption = CudaGraphs | Mapping[str, Any] | bool | None


def cudagraph_options(value: CudaGraphsOption) -> CudaGraphs | None:
    """``cudagraphs=`` as options: None/False off, True defaults, a dict or CudaGraphs."""
    if value is None or value is False:
        return None
    if value is True:
        return CudaGraphs()
    if isinstance(value, CudaGraphs):
        options = value
    elif isinstance(value, Mapping):
        unknown = set(value) - {"capture_sizes", "max_graphs", "pad", "copy_outputs"}
        if unknown:
            raise InvalidOptionError(f"cudagraphs got unknown options {sorted(unknown)}")
        options = CudaGraphs(
            capture_sizes=tuple(
                tuple(s) if isinstance(s, list) else s for s in value.get("capture_sizes", ())
            ),
            max_graphs=value.get("max_graphs", 64),
            pad=value["pad"] if isinstance(value.get("pad"), bool) else tuple(value.get("pad", ())),
            copy_outputs=value.get("copy_outputs", True),
        )
    else:
        raise InvalidOptionError(
            f"cudagraphs must be True, False, None, a dict or a CudaGraphs, got {value!r}"
        )
    if isinstance(options.max_graphs, bool) or not isinstance(options.max_graphs, int):
        raise InvalidOptionError(
            f"cudagraphs max_graphs must be an int, got {options.max_graphs!r}"
        )
    if options.max_graphs < 1:
        raise InvalidOptionError(f"cudagraphs max_graphs must be >= 1, got {options.max_graphs}")
    if not isinstance(options.pad, bool) and not all(isinstance(p, str) for p in options.pad):
        raise InvalidOptionError(
            f"cudagraphs pad must name symbols (or be True for all), got {options.pad!r}"
        )
    return options


def why_not_capturable(manifest: Manifest) -> str | None:
    """Why no variant of this artifact can be captured, or None."""
    if manifest.environment.device_type != "cuda":
        return f"the artifact runs on {manifest.environment.device_type}, not CUDA"
    for index, spec in enumerate(manifest.inputs):
        if not isinstance(spec, TensorInput) or spec.value is not None:
            continue
        if not spec.device.startswith("cuda"):
            return f"input {index} is a {spec.device} tensor (a graph replays GPU work only)"
        if spec.mutation == "metadata":
            return f"the graph resizes input {index} in place (a replay cannot follow that)"
    if manifest.training:
        return "the artifact carries a backward graph (only inference is captured)"
    if manifest.draws_random:
        # a capture runs the graph, drawing from the caller's generator: the call's own
        # draws would no longer be eager's
        return "the graph draws from the caller's random generator (dropout in training)"
    return None


@dataclass
class _Graph:
    """One captured replay of one variant at one size tuple."""

    graph: Any
    static_args: list[Any]
    copied: list[int]  # inputs copied into static buffers before each replay
    stable: list[int]  # parameters used in place, their addresses checked
    stable_ptrs: list[int | None]
    outputs: list[Any]
    lock: threading.Lock = field(default_factory=threading.Lock)
    # outputs of the run before capture, where that run was the call itself
    first_outputs: list[Any] | None = None
    released: bool = False

    def replay(self, args: Sequence[Any], copy_outputs: bool) -> list[Any] | None:
        """The outputs, or None where a parameter moved or the graph was released (the
        graph is stale)."""
        if self.stable and not adapter.data_ptrs_equal(list(args), self.stable_ptrs, self.stable):
            return None
        with self.lock:
            if self.released:
                return None
            if self.copied:
                torch._foreach_copy_(
                    [self.static_args[i] for i in self.copied], [args[i] for i in self.copied]
                )
            self.graph.replay()
            if not copy_outputs:
                return list(self.outputs)
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs]


# Held while a graph is captured, and by each step of a background warm-up: work of
# another thread during a capture (allocations, random increments on the generator the
# capture registered) breaks it ("Offset increment outside graph capture", allocator
# asserts). Not held by the caller's own other threads: their calls are theirs to order.
CAPTURE_LOCK = threading.RLock()

# Set while a caller captures a graph of its own around our calls (the decode loop's step
# graph): calls then run their variant plainly, recorded into the caller's graph.
_plain = threading.local()


@contextlib.contextmanager
def plain_calls() -> Iterator[None]:
    """Calls in this thread run their variants plainly (no replay, no capture of ours)."""
    before = getattr(_plain, "on", False)
    _plain.on = True
    try:
        yield
    finally:
        _plain.on = before


def _first_error(exc: BaseException) -> BaseException:
    """The error a failed capture hit first: ending a capture that failed inside makes
    torch raise again (an allocator assert, say), hiding the cause in ``__context__``."""
    seen = [exc]
    while seen[-1].__context__ is not None and len(seen) < 8:
        seen.append(seen[-1].__context__)
    return seen[-1]


class CaptureFailed(RuntimeError):
    """Capturing failed after the run before capture, which was the call itself (a graph
    that writes its inputs): ``outputs`` are that call's, so it must not run again."""

    def __init__(self, reason: BaseException, outputs: list[Any] | None) -> None:
        super().__init__(str(reason))
        self.reason = reason
        self.outputs = outputs


def _capture(
    function: Callable[..., Any],
    args: Sequence[Any],
    pool: Any,
    static: frozenset[int],
    writes: bool = False,
) -> _Graph:
    """Capture ``function`` at ``args``' sizes. ``writes``: the graph writes inputs in
    place, so the run before capture (on a side stream, where lazy initializations
    happen) is the call itself; its outputs are kept as ``first_outputs``, and a capture
    failing after it raises ``CaptureFailed`` with them (the call is not run twice)."""
    with CAPTURE_LOCK:
        return _capture_locked(function, args, pool, static, writes)


def _capture_locked(
    function: Callable[..., Any],
    args: Sequence[Any],
    pool: Any,
    static: frozenset[int],
    writes: bool,
) -> _Graph:
    static_args: list[Any] = []
    copied: list[int] = []
    stable: list[int] = []
    ptrs: list[int | None] = []
    for index, arg in enumerate(args):
        ptrs.append(None)
        if not isinstance(arg, torch.Tensor) or not arg.is_cuda:
            static_args.append(arg)
        elif index in static or isinstance(arg, torch.nn.Parameter):
            static_args.append(arg)
            stable.append(index)
            ptrs[index] = arg.data_ptr()
        else:
            buffer = torch.empty_strided(
                arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device
            )
            buffer.copy_(arg)
            static_args.append(buffer)
            copied.append(index)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = function(*static_args)  # outside capture: lazy inits happen here
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = function(*static_args)
    except Exception as exc:
        if writes:
            raise CaptureFailed(exc, list(first)) from exc
        raise
    for index in stable:  # used in place, checked by address: no reference kept
        static_args[index] = None
    captured = _Graph(graph, static_args, copied, stable, ptrs, list(outputs))
    if writes:
        captured.first_outputs = list(first)
    return captured


class CudaGraphExecutor:
    """Runs each size tuple from a CUDA graph captured on its first call (its second for
    a graph that writes its inputs), or at warm-up."""

    def __init__(self, manifest: Manifest, options: CudaGraphs) -> None:
        self.manifest = manifest
        self.symbols = manifest.symbol_names
        if not self.symbols:
            # One size only (Dynamo's static graphs): nothing to pad or capture ahead.
            options = dataclasses.replace(options, capture_sizes=(), pad=())
        elif options.pad is True:
            options = dataclasses.replace(options, pad=self.symbols)
        elif options.pad is False:
            options = dataclasses.replace(options, pad=())
        self.options = options
        assert not isinstance(options.pad, bool)
        unknown = [p for p in options.pad if p not in self.symbols]
        if unknown:
            raise InvalidOptionError(
                f"cudagraphs pad names {unknown}, which are not symbols of this artifact "
                f"({list(self.symbols)})"
            )
        self.reason = why_not_capturable(manifest)
        self._pool: Any = None
        self._lock = threading.RLock()
        self._graphs: dict[Sizes, _Graph] = {}
        self._refused: dict[Sizes, str] = {}
        self._said: set[str] = set()
        self._padding_refused: str | None = None
        self._pad: tuple[str, ...] = tuple(options.pad)
        # Used in place, bound to their address (checked before every replay): what
        # Dynamo marked static, and every input the graph writes, marked or not (a cache
        # first filled inside another torch.compile trace carries no mark): a copy would
        # take the write, not the caller's tensor.
        self._static = frozenset(
            i
            for i, spec in enumerate(manifest.inputs)
            if isinstance(spec, TensorInput) and (spec.static_address or spec.mutation == "data")
        )
        # The graph writes inputs in place (a KV cache): sizes are captured at their
        # second call, and nothing is padded (padded rows would be written too).
        self._writes = any(
            isinstance(spec, TensorInput) and spec.mutation != "none" for spec in manifest.inputs
        )
        self._calls: dict[Sizes, int] = {}
        register(self)
        self._pad_axes = [self.symbols.index(p) for p in self._pad]
        self._output_slicers = _output_slicers(manifest, options.pad)
        # Called with the first call's inputs (capture_sizes need a call's weights).
        self.first_call: Callable[[Sequence[Any]], None] | None = None
        if options.pad and self._output_slicers is None:
            self._padding_refused = (
                "an output's shape is not known or not a plain multiple of the padded symbols"
            )
        if options.pad and self._writes and self.reason is None:
            self.refuse_padding(
                "the graph writes its inputs in place (a KV cache): padded rows would be "
                "written into the caller's storage too; each size gets its own graph"
            )

    # -- what the dispatcher memoizes --------------------------------------------------
    def runner(
        self, sizes: Sizes, variant: int, function: Callable[..., Any]
    ) -> Callable[..., Any]:
        if self.reason is not None:
            self._say(f"CUDA graphs off for this artifact: {self.reason}; calls run plainly")
            return function
        return _Runner(self, sizes, function)

    def padded_target(self, sizes: Sizes) -> Sizes | None:
        """The smallest captured size tuple this one can be padded up to, if any."""
        if not self._pad_axes or self._padding_refused is not None:
            return None
        fits = [
            captured
            for captured in self._graphs
            if captured != sizes
            and all(
                (captured[a] >= sizes[a]) if a in self._pad_axes else captured[a] == sizes[a]
                for a in range(len(sizes))
            )
        ]
        return min(fits, key=lambda s: sum(s[a] for a in self._pad_axes)) if fits else None

    # -- state -------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning(message)

    @property
    def captured(self) -> tuple[Sizes, ...]:
        return tuple(self._graphs)

    def graph_for(
        self, sizes: Sizes, function: Callable[..., Any], args: Sequence[Any]
    ) -> _Graph | None:
        """The graph for ``sizes``, captured now from ``args`` if it is not yet; None where
        this size is not captured (refused, or over ``max_graphs``)."""
        return self.graph_or_outputs(sizes, function, args)[0]

    def graph_or_outputs(
        self, sizes: Sizes, function: Callable[..., Any], args: Sequence[Any]
    ) -> tuple[_Graph | None, list[Any] | None]:
        """``graph_for``, and the outputs of this call where capturing ran it (a graph
        that writes its inputs: the run before capture was the call)."""
        graph = self._graphs.get(sizes)
        if graph is not None or sizes in self._refused:
            return graph, None
        with self._lock:
            graph = self._graphs.get(sizes)
            if graph is not None or sizes in self._refused:
                return graph, None
            if self._writes:
                self._calls[sizes] = calls = self._calls.get(sizes, 0) + 1
                if calls < 2:
                    return None, None  # runs plainly; captured at its next call
            if len(self._graphs) >= self.options.max_graphs:
                self._evict_bound_elsewhere(args)
            if len(self._graphs) >= self.options.max_graphs:
                self._refused[sizes] = f"max_graphs={self.options.max_graphs} reached"
                self._say(f"CUDA graphs: {self._refused[sizes]}; other sizes run plainly")
                return None, None
            if self._pool is None or not self._graphs:
                # A pool whose graphs were all dropped may still hold their blocks (torch
                # keeps it until they are freed) and cannot take a new capture (an
                # allocator assert): a new pool, once no graph of the old one is left.
                self._pool = torch.cuda.graph_pool_handle()
            try:
                graph = _capture(function, args, self._pool, self._static, self._writes)
            except Exception as exc:  # capture failed: the size runs plainly
                failed = _first_error(exc.reason if isinstance(exc, CaptureFailed) else exc)
                text = str(failed).splitlines()[0][:200] if str(failed) else ""
                reason = f"{type(failed).__name__}: {text}"
                self._refused[sizes] = reason
                self._say(f"CUDA graph capture failed at sizes {sizes} ({reason}); runs plainly")
                # where the run before capture was the call, its outputs are this call's
                return None, exc.outputs if isinstance(exc, CaptureFailed) else None
            first, graph.first_outputs = graph.first_outputs, None
            self._graphs[sizes] = graph
            log.info(
                "captured a CUDA graph at sizes %s", dict(zip(self.symbols, sizes, strict=True))
            )
            return graph, first

    def release_graphs(self) -> int:
        """Destroy every graph captured here (see ``release_cuda_graphs``); each size is
        captured again as at its first call."""
        with self._lock:
            graphs = list(self._graphs.values())
            self._graphs.clear()
            self._calls.clear()
            self._pool = None
        for graph in graphs:
            with graph.lock:  # a replay in another thread finishes first
                graph.released = True
                graph.graph.reset()
        return len(graphs)

    def drop(self, sizes: Sizes, why: str) -> None:
        with self._lock:
            self._graphs.pop(sizes, None)
            self._calls[sizes] = 1  # this call runs plainly; the next one captures
        self._say(f"CUDA graph at sizes {sizes} dropped: {why}; it is captured again")

    def _evict_bound_elsewhere(self, args: Sequence[Any]) -> None:
        """Drop graphs captured on other storage than this call's in-place inputs (the
        caches of finished requests): they would be dropped at their next replay anyway."""
        for sizes, graph in list(self._graphs.items()):
            indices = [i for i in graph.stable if isinstance(args[i], torch.Tensor)]
            if indices and not adapter.data_ptrs_equal(list(args), graph.stable_ptrs, indices):
                del self._graphs[sizes]
                log.info("CUDA graph at sizes %s evicted: captured on other storage", sizes)

    def verify_padding(
        self,
        run_plain: Callable[[Sizes], tuple[list[Any], list[Any]] | None],
        replay: Callable[[Sizes, list[Any]], Any],
    ) -> None:
        """Check one padded replay against an unpadded run; refuse padding if they differ.
        ``run_plain(sizes)`` gives (args, outputs) of a plain run at ``sizes``, or None
        where no variant admits them. bf16/fp16 outputs are compared within 2e-2, as a
        different row count may pick other kernels; a dim that is not independent (a
        mean over rows, non-causal attention) differs by far more."""
        if not self._pad_axes or self._padding_refused is not None or not self._graphs:
            return
        probe: Sizes | None = None
        for target in sorted(self._graphs, key=lambda s: sum(s[a] for a in self._pad_axes)):
            below = tuple(v - 1 if a in self._pad_axes else v for a, v in enumerate(target))
            if min(below[a] for a in self._pad_axes) < 1 or below in self._graphs:
                continue
            plain = run_plain(below)
            if plain is not None:  # None: no variant admits it (Dynamo's static size 1)
                probe, smallest = below, target
                args, expected = plain
                break
        if probe is None:
            return
        got = replay(probe, args)
        for want, have in zip(expected, got, strict=True):
            if not isinstance(want, torch.Tensor):
                continue
            loose = want.dtype in (torch.float16, torch.bfloat16)
            if not torch.allclose(have.float(), want.float(), rtol=2e-2 if loose else 1e-3,
                                  atol=2e-2 if loose else 1e-4):  # fmt: skip
                self.refuse_padding(
                    f"a padded replay at sizes {probe} (padded to {smallest}) differs from an "
                    "unpadded run: the padded dims are not independent"
                )
                return
        log.info("CUDA graph padding checked at sizes %s against an unpadded run", probe)

    def refuse_padding(self, why: str) -> None:
        self._padding_refused = why
        self._say(f"CUDA graph padding refused for this artifact: {why}")

    # -- padding -----------------------------------------------------------------------
    def padded_args(self, args: Sequence[Any], sizes: Sizes, target: Sizes) -> list[Any]:
        """``args`` for ``target`` sizes: padded dims zero-filled past the real sizes."""
        values = dict(zip(self.symbols, sizes, strict=True))
        big = dict(zip(self.symbols, target, strict=True))
        padded: list[Any] = []
        for spec, arg in zip(self.manifest.inputs, args, strict=True):
            if isinstance(spec, IntInput):
                padded.append(
                    big[spec.value] if isinstance(spec.value, str) and spec.value in big else arg
                )
                continue
            grow = [
                (dim, big[size] - values[size])
                for dim, size in enumerate(spec.shape)
                if isinstance(size, str) and size in self._pad and big[size] != values[size]
            ]
            if not grow or not isinstance(arg, torch.Tensor):
                padded.append(arg)
                continue
            shape = list(arg.shape)
            for dim, extra in grow:
                shape[dim] += extra
            out = arg.new_zeros(shape)
            out[tuple(slice(0, n) for n in arg.shape)] = arg
            padded.append(out)
        return padded

    def padded_call(
        self, sizes: Sizes, target: Sizes, function: Callable[..., Any], args: Sequence[Any]
    ) -> list[Any]:
        """Run ``sizes`` on the graph of ``target`` (larger in the padded dims)."""
        graph = self._graphs.get(target)
        if graph is None:
            return list(function(*args))
        outputs = graph.replay(self.padded_args(args, sizes, target), copy_outputs=False)
        if outputs is None:
            self.drop(target, "a parameter moved (its address changed)")
            return list(function(*args))
        cut = self.unpad(outputs, sizes)
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in cut]

    def unpad(self, outputs: list[Any], sizes: Sizes) -> list[Any]:
        assert self._output_slicers is not None
        return [
            slicer(output, sizes)
            if slicer is not None and isinstance(output, torch.Tensor)
            else output
            for slicer, output in zip(self._output_slicers, outputs, strict=True)
        ]


def _output_slicers(
    manifest: Manifest, pad: Sequence[str]
) -> list[Callable[[torch.Tensor, Sizes], torch.Tensor] | None] | None:
    """Per output, how to cut a padded replay's output back to the real sizes: each dim
    that depends on a padded symbol is narrowed to its value at the real sizes (that is a
    prefix only when the dim is the symbol itself); None where not possible."""
    if not pad:
        return []
    if manifest.output_shapes is None:
        return None
    names = manifest.symbol_names
    slicers: list[Callable[[torch.Tensor, Sizes], torch.Tensor] | None] = []
    for shape in manifest.output_shapes:
        if shape is None:
            return None
        dims = []
        for dim, size in enumerate(shape):
            if isinstance(size, int):
                continue
            if size in pad:
                dims.append((dim, names.index(size)))
            elif any(re.search(rf"\b{p}\b", size) for p in pad):
                return None  # s0*4, s0+1...: not a prefix of the padded output
        if not dims:
            slicers.append(None)
            continue

        def slicer(
            output: torch.Tensor, sizes: Sizes, dims: list[tuple[int, int]] = dims
        ) -> torch.Tensor:
            for dim, axis in dims:
                output = output.narrow(dim, 0, sizes[axis])
            return output

        slicers.append(slicer)
    return slicers


class _Runner:
    """What the dispatcher memoizes for one size tuple under CUDA graphs."""

    def __init__(self, executor: CudaGraphExecutor, sizes: Sizes, function: Callable[..., Any]):
        self.executor = executor
        self.sizes = sizes
        self.function = function

    def __call__(self, *args: Any) -> Any:
        if getattr(_plain, "on", False):
            return self.function(*args)
        executor = self.executor
        if executor.first_call is not None:
            hook, executor.first_call = executor.first_call, None
            hook(args)
        graph = executor._graphs.get(self.sizes)
        if graph is None:
            target = executor.padded_target(self.sizes)
            if target is not None:
                return executor.padded_call(self.sizes, target, self.function, args)
            graph, first = executor.graph_or_outputs(self.sizes, self.function, args)
            if first is not None:  # capturing ran this call (a graph that writes inputs)
                return first
            if graph is None:
                return self.function(*args)
        outputs = graph.replay(args, executor.options.copy_outputs)
        if outputs is None:
            executor.drop(
                self.sizes,
                "released (release_cuda_graphs)"
                if graph.released
                else "an input used in place moved (another cache object, or a parameter replaced)",
            )
            return self.function(*args)
        return outputs
