"""``release_cuda_graphs``: every registered holder of captured graphs is emptied and its
graphs destroyed, except a decode-step graph a running generate holds (dropped from its
holder, freed when that generate ends). Captures nothing: the graphs are stand-ins."""

from __future__ import annotations

import precompile
from precompile.runtime._decode_graphs import DecodeGraphs, StepGraph


class _Graph:
    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_release_destroys_every_held_graph_but_one_in_use() -> None:
    graphs = DecodeGraphs(lambda arguments: (), max_graphs=4)
    idle, busy = _Graph(), _Graph()
    for key, graph in (("idle", idle), ("busy", busy)):
        graphs._graphs[key] = StepGraph(graph, None, (), None)  # type: ignore[arg-type]
    held = graphs.take("busy")  # a generate running on it
    assert held is not None
    assert precompile.release_cuda_graphs() >= 2
    assert len(graphs) == 0 and graphs.take("idle") is None
    assert idle.resets == 1 and busy.resets == 0  # the running generate keeps its graph
    graphs.give(held)
    assert precompile.release_cuda_graphs() == 0  # nothing left to release
