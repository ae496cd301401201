"""The key of a graph on one CUDA device leaves its index out (``one_device_index``):
ranks on other devices of the GPU model find it and move it there. A graph on two
devices, or whose code names another, keeps its index. Compiles nothing."""

from __future__ import annotations

import torch

from precompile._cache_key import graph_digest, one_device_index
from precompile._graph import GraphDescription, GraphInput


def _graph(*devices: str | None) -> GraphDescription:
    inputs = tuple(
        GraphInput(kind="int") if d is None else GraphInput(kind="tensor", device=torch.device(d))
        for d in devices
    )
    return GraphDescription(inputs=inputs, symbols=(), hints={}, ranges={}, caller_shape_env=None)


def _traced(device: str) -> torch.fx.GraphModule:
    """``x + torch.ones(3, device=device)``, built by hand (nothing runs on the device)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ones = graph.call_function(torch.ones, (3,), {"device": torch.device(device)})
    graph.output(graph.call_function(torch.add, (x, ones)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_one_device_graphs_are_keyed_without_their_index() -> None:
    plain = torch.fx.symbolic_trace(lambda x: x * 2)
    assert one_device_index(plain, _graph("cuda:1", None, "cuda:1")) == 1
    assert one_device_index(plain, _graph("cuda:0")) == 0
    assert one_device_index(plain, _graph("cuda:0", "cuda:1")) is None  # two devices
    assert one_device_index(plain, _graph("cpu")) is None
    assert one_device_index(plain, _graph("cuda")) is None  # no index named
    # code naming another device than the inputs': the index stays in the key
    assert one_device_index(_traced("cuda:0"), _graph("cuda:1")) is None
    assert one_device_index(_traced("cuda:1"), _graph("cuda:1")) == 1
    # the same code on two devices digests alike with the index left out, not with it
    on_0, on_1 = _traced("cuda:0"), _traced("cuda:1")
    assert graph_digest(on_0, 0) == graph_digest(on_1, 1)
    assert graph_digest(on_0) != graph_digest(on_1)
