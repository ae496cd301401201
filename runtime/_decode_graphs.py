"""CUDA graphs of whole decode steps, for ``CompiledModel.generate`` with CUDA graphs on:
the forward, the choice of the next token (sampling too, from a generator registered with
the graph: its own, given the caller's generator's state before the steps and giving it
back after, or torch's default one) and the advance of the step's buffers (input ids,
cache position, mask, positions, finished rows), captured once and replayed per token.
A step then costs one graph launch and no per-call checks on the host; the per-size
graphs of the artifact replay the forward only, each call checked.

A graph bakes in the address of every tensor it reads or writes: the model's weights,
the cache's tensors and the step's buffers (which the graph owns). Graphs are kept per
batch, cache addresses and choice settings; before a generate replays one, its step call
is checked as any call is (mode, hooks, what the trace read) and each of its graph
inputs' address, dtype, shape and strides are compared with those at capture: a graph
whose inputs moved or changed (a replaced parameter) is dropped and captured again. A
graph runs one generate at a time: another thread's generate on it runs its steps
without the graph.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _torch_adapter as adapter
from ._cudagraphs import CAPTURE_LOCK, plain_calls
from ._graph_release import register

log = logging.getLogger("precompile.runtime")


@dataclass
class StepBuffers:
    """What one decode step reads and advances in place."""

    ids: torch.Tensor  # [batch, 1]: the step's input tokens, then the tokens it chose
    position: torch.Tensor  # [1]: the cache position the step writes
    unfinished: torch.Tensor  # [batch] bool: rows not yet at EOS
    eos: torch.Tensor  # the EOS ids (empty: none)
    mask: torch.Tensor | None = None  # [batch, max_cache_len]: 1 where a token is
    positions: torch.Tensor | None = None  # [batch, 1]: the rows' position ids


@dataclass
class StepGraph:
    """One captured decode step and the buffers it was captured on."""

    graph: Any
    buffers: StepBuffers
    layouts: tuple[Hashable, ...]  # of the step's graph inputs at capture
    generator: torch.Generator | None  # its own, registered with it (None: the default)
    busy: threading.Lock = field(default_factory=threading.Lock)


class DecodeGraphs:
    """A compiled model's decode-step graphs, at most ``max_graphs`` (least recently used
    dropped first). ``layouts(arguments)`` checks a step call as any call is checked and
    gives its graph inputs' addresses and layouts, which a graph bakes in."""

    def __init__(
        self, layouts: Callable[[dict[str, Any]], tuple[Hashable, ...]], max_graphs: int = 8
    ) -> None:
        self._layouts = layouts
        self._max = max_graphs
        self._graphs: OrderedDict[Hashable, StepGraph] = OrderedDict()
        self._refused: set[Hashable] = set()
        self._lock = threading.Lock()
        register(self)

    def release_graphs(self) -> int:
        """Destroy the step graphs no generate holds now (see ``release_cuda_graphs``);
        one a generate holds is dropped from here and freed when that generate ends."""
        with self._lock:
            graphs = list(self._graphs.values())
            self._graphs.clear()
        for graph in graphs:
            if graph.busy.acquire(blocking=False):
                graph.graph.reset()
                graph.busy.release()
        return len(graphs)

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._graphs

    def take(self, key: Hashable) -> StepGraph | None:
        """The graph for ``key``, held for this generate (release it with ``give``), or
        None where there is none or another thread holds it."""
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None or not graph.busy.acquire(blocking=False):
                return None
            self._graphs.move_to_end(key)
            return graph

    def give(self, graph: StepGraph) -> None:
        graph.busy.release()

    def current(self, graph: StepGraph, key: Hashable, arguments: dict[str, Any]) -> bool:
        """Whether ``graph``'s inputs are where and as they were at capture; a graph whose
        are not is dropped (and released). A call that its checks refuse raises, the
        graph released."""
        try:
            same = self._layouts(arguments) == graph.layouts
        except BaseException:
            graph.busy.release()
            raise
        if same:
            return True
        log.info("decode step graph dropped: a tensor it reads moved or changed")
        with self._lock:
            if self._graphs.get(key) is graph:
                del self._graphs[key]
        graph.busy.release()
        return False

    def refused(self, key: Hashable) -> bool:
        return key in self._refused

    def capture(
        self,
        key: Hashable,
        step: Callable[[], None],
        buffers: StepBuffers,
        arguments: dict[str, Any],
        generator: torch.Generator | None,
    ) -> StepGraph | None:
        """Run ``step`` once (this step, on a side stream, where lazy initializations
        happen), then capture it; the graph is returned held. None where it could not
        be captured (logged; the step ran, the next ones run without a graph)."""
        with CAPTURE_LOCK, plain_calls():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if generator is not None and not adapter.register_graph_generator(graph, generator):
                self._refuse(key, "this torch cannot register a generator with a graph")
                return None
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    step()
            except Exception as exc:  # a capture error means: run without the graph
                self._refuse(key, f"capture failed: {exc}")
                return None
        captured = StepGraph(graph, buffers, self._layouts(arguments), generator)
        captured.busy.acquire()
        with self._lock:
            self._graphs[key] = captured
            self._graphs.move_to_end(key)
            while len(self._graphs) > self._max:
                self._graphs.popitem(last=False)
        return captured

    def _refuse(self, key: Hashable, reason: str) -> None:
        log.warning("decode steps run without a step graph: %s", reason)
        self._refused.add(key)
        return None


@dataclass(frozen=True)
class GraphedSteps:
    """What a generate needs to capture its decode step: the model's graphs, its step
    call without the cache guard (captured: the loop checks lengths itself) and the
    cache guard's ``drop`` (replays write the cache where its mirror does not see)."""

    graphs: DecodeGraphs
    call: Callable[..., Any]
    stale: Callable[[Any], None]
