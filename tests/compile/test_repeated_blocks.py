"""Repeated blocks compiled once (``precompile._repeated_blocks``): a model of identical
layers compiles one layer body per variant, whatever its depth, and answers as eager."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import torch

import precompile
from precompile import _repeated_blocks as repeated_blocks
from precompile._cache_key import graph_digest
from precompile._random_policy import draws_random
from precompile.runtime import InvalidOptionError


@pytest.fixture(autouse=True)
def _blocks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outlining is opt-in (``PRECOMPILE_REPEATED_BLOCKS=1``): on for these tests."""
    monkeypatch.setenv("PRECOMPILE_REPEATED_BLOCKS", "1")


class Norm(torch.nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(torch.nn.Module):
    """An RMS-normed residual MLP: what a transformer layer repeats, in small."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = Norm(width, eps)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    """Blocks, a final norm and a head, as a transformer ends."""

    def __init__(
        self, depth: int, width: int = 16, eps: list[float] | None = None, final_norm: bool = True
    ) -> None:
        super().__init__()
        eps = eps or [1e-6] * depth
        self.blocks = torch.nn.ModuleList(Block(width, e) for e in eps)
        self.norm = Norm(width) if final_norm else torch.nn.Identity()
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class WritingBlock(Block):
    """A block that writes a buffer in place (as a KV cache is written) and reads it."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.register_buffer("seen", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        self.seen.add_(h.sum(0))
        return h * 2 + self.seen


class WritingStack(torch.nn.Module):
    def __init__(self, depth: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(WritingBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


_EXAMPLE = "example"


def _captured(model: torch.nn.Module, rows: int = 6) -> tuple[torch.fx.GraphModule, list[Any]]:
    torch.manual_seed(0)
    example = torch.randn(rows, 16)
    gm, inputs = precompile.capture_graph(model, example, dynamic={0: [0]})
    return gm, [_EXAMPLE if value is example else value for value in inputs]


def _flat(example_inputs: list[Any], x: torch.Tensor) -> list[Any]:
    """The graph's flat inputs for a call with ``x``: its size for the SymInt, x itself."""
    flat: list[Any] = []
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            flat.append(x.shape[0])
        elif isinstance(value, str) and value == _EXAMPLE:
            flat.append(x)
        else:
            flat.append(value)
    return flat


def test_identical_layers_share_one_subgraph_and_answer_as_traced() -> None:
    model = Stack(depth=5).eval()
    gm, inputs = _captured(model)
    before = gm.code
    outlined = repeated_blocks.outline(gm)
    assert gm.code == before  # the caller's graph is not changed
    assert len(outlined.groups) == 1
    group = outlined.groups[0]
    assert len(group.instances) == 5 and group.module_class.endswith("Block")
    calls = [n for n in outlined.gm.graph.nodes if "invoke_subgraph" in str(n.target)]
    assert len(calls) == 5
    x = torch.randn(9, 16)
    with torch.no_grad():
        torch.testing.assert_close(outlined.gm(*_flat(inputs, x))[0], model(x))


def test_a_window_begins_at_a_layers_first_matmul_and_ends_before_the_next() -> None:
    """What ends a layer (the residual add) and begins the next (its norm) stay in one
    window, where inductor fuses them; so the last layer's window holds the model's final
    norm, and without one (the head follows at once) it differs and stays inline."""
    gm, _ = _captured(Stack(depth=3).eval())
    outlined = repeated_blocks.outline(gm)
    (group,) = outlined.groups
    body = getattr(outlined.gm, group.name)
    calls = [n for n in body.graph.nodes if n.op == "call_function"]
    assert calls[0].target is torch._C._nn.linear  # the first matmul begins it
    assert str(calls[-1].target) == "<built-in function mul>"  # the next norm ends it
    gm, _ = _captured(Stack(depth=3, final_norm=False).eval())
    (group,) = repeated_blocks.outline(gm).groups
    assert len(group.instances) == 2


def test_a_layer_with_other_constants_keeps_a_body_of_its_own() -> None:
    """The norm with ``eps`` 0.5 begins layer 2, so it sits in layer 1's window: that
    window is not shared (each window ends with the next layer's norm)."""
    model = Stack(depth=4, eps=[1e-6, 1e-6, 0.5, 1e-6]).eval()
    gm, inputs = _captured(model)
    outlined = repeated_blocks.outline(gm)
    shared = [set(g.instances) for g in outlined.groups]
    assert len(shared) == 1 and len(shared[0]) == 3
    assert not any(path.endswith(("1", "[1]")) for path in shared[0])
    x = torch.randn(7, 16)
    with torch.no_grad():
        torch.testing.assert_close(outlined.gm(*_flat(inputs, x))[0], model(x))


def test_in_place_writes_stay_in_the_outer_graph() -> None:
    model = WritingStack(depth=3).eval()
    gm, inputs = _captured(model)
    outlined = repeated_blocks.outline(gm)
    assert outlined.groups, "the pieces between the writes are still shared"
    for group in outlined.groups:
        body = getattr(outlined.gm, group.name)
        assert not any(repeated_blocks._writes(n) for n in body.graph.nodes)
    writes = [n for n in outlined.gm.graph.nodes if repeated_blocks._writes(n)]
    assert len(writes) == 3  # one add_ per block, between its pieces
    x = torch.randn(5, 16)
    plain, other = [_flat(inputs, x) for _ in range(2)]
    # each run writes the buffers: run the traced and the outlined graph on copies
    plain = [v.clone() if isinstance(v, torch.Tensor) else v for v in plain]
    other = [v.clone() if isinstance(v, torch.Tensor) else v for v in other]
    with torch.no_grad():
        expected = gm(*plain)[0]
        actual = outlined.gm(*other)[0]
    torch.testing.assert_close(actual, expected)
    for a, b in zip(plain, other, strict=True):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b)  # the same buffers written the same way


def test_a_graph_with_nothing_repeated_is_compiled_as_traced() -> None:
    gm, _ = _captured(Block(16).eval())
    outlined = repeated_blocks.outline(gm)
    assert outlined.gm is gm and outlined.groups == ()


def test_the_setting_is_checked_and_keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default (unset), on with 1; a typo is an error naming the variable; the
    setting is a key factor, so a build under the other one is a miss."""
    gm, _ = _captured(Stack(depth=2).eval())
    on = repeated_blocks.policy()
    monkeypatch.delenv("PRECOMPILE_REPEATED_BLOCKS")
    assert repeated_blocks.outline(gm).groups == ()
    off = repeated_blocks.policy()
    assert off != on
    monkeypatch.setenv("PRECOMPILE_REPEATED_BLOCKS", "0")
    assert repeated_blocks.outline(gm).groups == () and repeated_blocks.policy() == off
    monkeypatch.setenv("PRECOMPILE_REPEATED_BLOCKS", "sometimes")
    with pytest.raises(InvalidOptionError, match="PRECOMPILE_REPEATED_BLOCKS"):
        repeated_blocks.outline(gm)


def test_a_subgraphs_code_is_part_of_the_graphs_digest() -> None:
    first = repeated_blocks.outline(_captured(Stack(depth=2).eval())[0]).gm
    second = repeated_blocks.outline(_captured(Stack(depth=2).eval())[0]).gm
    assert graph_digest(first) == graph_digest(second)
    body = getattr(second, second.graph.find_nodes(op="get_attr")[0].target)
    node = next(n for n in body.graph.nodes if n.target is torch.nn.functional.gelu)
    node.target = torch.nn.functional.silu  # the same outer code, another body
    body.recompile()
    assert graph_digest(first) != graph_digest(second)


def _kernels(artifact: precompile.CompiledArtifact) -> int:
    """The kernels the artifact's generated code defines (C++ on this CPU)."""
    counts = []
    for variant in artifact.variants:
        assert variant.lean is not None, "the generated code is read from the lean path"
        source = artifact.payload_bytes(variant.lean.source).decode()
        counts.append(len(set(re.findall(r"\bcpp_fused_\w+", source))))
    return max(counts)


@pytest.mark.slow
def test_a_deeper_model_compiles_no_more_layer_bodies(tmp_path: Any) -> None:
    """One layer body per variant, whatever the depth: the kernels of a 6-layer stack
    are those of a 2-layer one, and both answer as eager."""
    counts = {}
    for depth in (2, 6):
        model = Stack(depth=depth).eval()
        gm, inputs = _captured(model)
        with torch.no_grad():
            example = torch.randn(6, 16)
            artifact = precompile.standalone_compile(
                gm, _flat(inputs, example), hints=[16], cache=os.path.join(tmp_path, str(depth))
            )
            for rows in (2, 5, 40):
                x = torch.randn(rows, 16)
                torch.testing.assert_close(artifact(*_flat(inputs, x))[0], model(x))
        counts[depth] = _kernels(artifact)
    assert counts[6] == counts[2], counts


def test_cache_ls_names_the_blocks_compiled_once(tmp_path: Any) -> None:
    from cache_helpers import cache_cli

    from precompile.cache import ArtifactCache

    model = Stack(depth=3).eval()
    x = torch.randn(5, 16)
    torch._dynamo.mark_dynamic(x, 0)
    store = ArtifactCache(str(tmp_path))
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=precompile.backend(hints=[16], cache=store))(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, model(x))
    listed = cache_cli("--root", str(tmp_path), "ls")
    assert listed.returncode == 0, listed.stderr
    assert "compiled once: 3 x Block (" in listed.stdout, listed.stdout
    (entry,) = json.loads(cache_cli("--root", str(tmp_path), "ls", "--json").stdout)
    assert entry["blocks"].startswith("3 x Block (")


class _DropoutBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.dropout(super().forward(x) - x, 0.5, training=True)


def test_random_draws_stay_in_the_outer_graph() -> None:
    """Dropout in training draws once per layer, in order: outside every subgraph, so a
    shared subgraph never repeats one layer's draw in another."""

    class Stacked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(_DropoutBlock(16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    gm, inputs = _captured(Stacked().eval())
    outlined = repeated_blocks.outline(gm)
    for group in outlined.groups:
        body = getattr(outlined.gm, group.name)
        assert not any(draws_random(n) for n in body.graph.nodes)
    draws = [n for n in outlined.gm.graph.nodes if draws_random(n)]
    assert len(draws) == 3
    x = torch.randn(5, 16)
    torch.manual_seed(1)
    expected = gm(*_flat(inputs, x))[0]
    torch.manual_seed(1)
    torch.testing.assert_close(outlined.gm(*_flat(inputs, x))[0], expected)
