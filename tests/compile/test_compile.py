"""Compiled variants against eager: correctness sweeps, guards, dedupe, caller safety."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import ATTN_HINTS, MLP_HINTS, MLP_SIZES, Compiled, assert_close

import precompile

MLP_SWEEP = [1, 2, 3, 5, 7, 13, 16, 17, 31, 100, 256, 257, 1000, 4099]


def test_mlp_matches_eager_over_sweep(mlp: Compiled) -> None:
    model = mlp.captured.model
    for n in MLP_SWEEP:
        x = torch.randn(n, 32)
        with torch.no_grad():
            out = mlp.artifact(*mlp.captured.flat(x))
            assert_close(out, model(x))


def test_mlp_variant_layout(mlp: Compiled) -> None:
    art = mlp.artifact
    assert len(art.symbols) == 1
    symbol = art.symbols[0]
    kinds = [(v.kind, v.point[symbol.name]) for v in art.variants]
    assert kinds == [("hint", h) for h in MLP_HINTS] + [("static", s) for s in MLP_SIZES]
    # every placeholder that carries the symbol is listed as a source
    assert any(src.dim == 0 for src in symbol.sources)


def test_dispatch_choices_on_mlp(mlp: Compiled) -> None:
    art, flat = mlp.artifact, mlp.captured.flat
    by_point = {(v.kind, next(iter(v.point.values()))): v.index for v in art.variants}
    expected = {
        1: by_point[("hint", 1)],  # only the hint-1 variant admits size 1
        3: by_point[("static", 3)],  # exact size wins over every hint
        5: by_point[("hint", 16)],
        20: by_point[("hint", 16)],
        100: by_point[("hint", 256)],
        5000: by_point[("hint", 256)],  # above the largest hint: nearest one
    }
    for n, index in expected.items():
        assert art.variant_for(*flat(torch.randn(n, 32))) == index, n


def test_hint_one_variant_guards_exclude_other_sizes(mlp: Compiled) -> None:
    """Hint 1 specializes the batch to 1; its guards must keep it away from size 2."""
    art, flat = mlp.artifact, mlp.captured.flat
    hint_one = next(v for v in art.variants if v.kind == "hint" and 1 in v.point.values())
    assert hint_one.guards, "the hint-1 variant should carry a guard"
    explanation = art.explain(*flat(torch.randn(2, 32)))
    # by log2 distance alone hint 1 is nearest to 2 ...
    nearest = min((c for c in explanation.candidates if c.kind == "hint"), key=lambda c: c.distance)
    assert nearest.variant == hint_one.index
    # ... but its guards fail, so another variant serves size 2
    assert nearest.failed_guards
    assert explanation.chosen != hint_one.index
    assert explanation.decided_by in ("nearest-hint", "only-variant")


def test_attention_two_dynamic_dims_match_eager(attention: Compiled) -> None:
    model = attention.captured.model
    for batch in [1, 2, 3, 8, 11]:
        for seq in [1, 7, 16, 33, 64, 130]:
            x = torch.randn(batch, seq, 32)
            with torch.no_grad():
                out = attention.artifact(*attention.captured.flat(x))
                assert_close(out, model(x))


def test_attention_is_cartesian_product_of_hints(attention: Compiled) -> None:
    art = attention.artifact
    assert len(art.symbols) == 2
    points = sorted(tuple(v.point.values()) for v in art.variants)
    expected = sorted((b, s) for b in ATTN_HINTS["batch"] for s in ATTN_HINTS["seq"])
    assert points == expected


def test_attention_dispatch_is_nearest_in_log2_space(attention: Compiled) -> None:
    art, flat = attention.artifact, attention.captured.flat
    for batch, seq in [(2, 16), (3, 20), (7, 60), (8, 200), (2, 40)]:
        explanation = art.explain(*flat(torch.randn(batch, seq, 32)))
        admissible = [c for c in explanation.candidates if c.admissible]
        best = min(admissible, key=lambda c: (c.distance, c.variant))
        assert explanation.chosen == best.variant


def test_identical_code_is_stored_once(mlp: Compiled, attention: Compiled) -> None:
    for art in (mlp.artifact, attention.artifact):
        codes = {v.code for v in art.variants}
        assert len(art.manifest.graph_digests) == len(codes)
        for variant in art.variants:
            same_code = [v for v in art.variants if v.code == variant.code]
            assert {v.payload for v in same_code} == {variant.payload}


def test_compile_leaves_caller_graph_unchanged() -> None:
    """The caller's graph, its fake values and its ShapeEnv are the caller's: a variant
    compiled at hint 1 (which specializes its own copy of the batch symbol) must leave no
    trace there, beyond the guards every variant shares."""
    from conftest import MLP, capture

    torch.manual_seed(1)
    captured = capture(MLP(width=32, hidden=64).eval(), torch.randn(4, 32))
    nodes = list(captured.gm.graph.nodes)
    env = next(
        n.meta["example_value"].fake_mode.shape_env
        for n in nodes
        if hasattr(n.meta.get("example_value"), "fake_mode")
    )
    code_before = captured.gm.code
    metas_before = [n.meta.get("example_value") for n in nodes]
    layouts_before = [
        (tuple(m.shape), m.stride()) if isinstance(m, torch.Tensor) else m for m in metas_before
    ]
    values_before = dict(env.backed_var_to_val)
    replacements_before = dict(env.replacements)
    guards_before = [str(g.expr) for g in env.guards]
    with torch.no_grad():
        art = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[1, 8], cache=False
        )
    hint_one = next(v for v in art.variants if dict(v.point) == {art.symbols[0].name: 1})
    assert hint_one.guards, "the hint-1 variant should carry guards of its own"
    assert captured.gm.code == code_before
    assert list(captured.gm.graph.nodes) == nodes
    metas_after = [n.meta.get("example_value") for n in nodes]
    assert all(a is b for a, b in zip(metas_after, metas_before, strict=True))
    layouts_after = [
        (tuple(m.shape), m.stride()) if isinstance(m, torch.Tensor) else m for m in metas_after
    ]
    assert layouts_after == layouts_before
    assert dict(env.backed_var_to_val) == values_before
    assert dict(env.replacements) == replacements_before
    # hint 1 guards s == 1 and hint 8 guards s != 1: no guard is common, none may leak
    assert [str(g.expr) for g in env.guards] == guards_before


def test_too_many_variants_fail_before_compiling(
    mlp: Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    from precompile import _variant_compile

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled although the request was invalid")

    monkeypatch.setattr(_variant_compile, "compile_variant", refuse)
    gm, inputs = mlp.captured.gm, mlp.captured.example_inputs
    with pytest.raises(precompile.InvalidOptionError, match="max_variants=4"):
        precompile.standalone_compile(gm, inputs, hints=[1, 2, 3, 4, 5], max_variants=4)
    with pytest.raises(ValueError, match="symbol 'batch'"):
        precompile.standalone_compile(gm, inputs, hints={"batch": [4]})
    with pytest.raises(precompile.InvalidOptionError, match="not a dynamic dim"):
        precompile.standalone_compile(gm, inputs, hints={(0, 0): [4]})
    with pytest.raises(precompile.InvalidOptionError, match="dynamic_shapes"):
        precompile.standalone_compile(gm, inputs, dynamic_shapes="from_nowhere")
    with pytest.raises(precompile.InvalidOptionError, match="options"):
        precompile.standalone_compile(gm, inputs, options=["max_autotune"])  # type: ignore[arg-type]
    # a misspelt inductor setting, or one outside config_patches: named before any compile
    # (inductor failed on it inside the first variant's compile)
    misspelt = {"config_patches": {"max_autotune_gem": 1}}
    with pytest.raises(precompile.InvalidOptionError, match=r"\['max_autotune_gem'\]"):
        precompile.standalone_compile(gm, inputs, options=misspelt)
    with pytest.raises(precompile.InvalidOptionError, match="no keyword of inductor's compile_fx"):
        precompile.standalone_compile(gm, inputs, options={"max_autotune": True})
    with pytest.raises(precompile.InvalidOptionError, match="must be a dict of inductor config"):
        precompile.standalone_compile(gm, inputs, options={"config_patches": "max_autotune"})
    with pytest.raises(precompile.InvalidOptionError, match="hints entry"):
        precompile.standalone_compile(gm, inputs, hints=[-4])
    with pytest.raises(precompile.InvalidOptionError, match="placeholders"):
        precompile.standalone_compile(gm, inputs[:-1])


def test_from_example_inputs_compiles_static(mlp: Compiled) -> None:
    """Like upstream: the graph is specialized to the real example inputs' sizes."""
    captured = mlp.captured
    x = torch.randn(6, 32)
    real = [a.detach() if isinstance(a, torch.Tensor) else a for a in captured.flat(x)]
    with torch.no_grad():
        art = precompile.standalone_compile(captured.gm, real, dynamic_shapes="from_example_inputs")
        assert art.symbols == ()
        assert len(art.variants) == 1
        assert_close(art(*real), captured.model(x))
        with pytest.raises(
            precompile.InputMismatchError, match=r"should be 6, got 7|static and must be 6"
        ):
            art(*captured.flat(torch.randn(7, 32)))
        # Hints cannot apply to a graph without dynamic dims: one variant, as upstream.
        again = precompile.standalone_compile(
            captured.gm, real, dynamic_shapes="from_example_inputs", hints=[4], sizes=[2]
        )
        assert len(again.variants) == 1
        assert_close(again(*real), captured.model(x))


def test_from_tracing_context_needs_a_backend(mlp: Compiled) -> None:
    with pytest.raises(precompile.InvalidOptionError, match="tracing context"):
        precompile.standalone_compile(
            mlp.captured.gm, mlp.captured.example_inputs, dynamic_shapes="from_tracing_context"
        )


class _Reshaper(torch.nn.Module):
    """Uses its SymInt placeholder in a view, which static variants used to trip on."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).view(x.shape[0], 3, 4).sum(1)


def test_static_variants_of_a_graph_that_views_by_its_size_input() -> None:
    from demo import capture as capture_marked

    torch.manual_seed(0)
    model = _Reshaper().eval()
    gm, example_inputs = capture_marked(model, torch.randn(6, 8))
    assert any(isinstance(v, torch.SymInt) for v in example_inputs)
    with torch.no_grad():
        art = precompile.standalone_compile(
            gm, example_inputs, hints=[4], sizes=[1, 2], cache=False
        )
    assert [v.kind for v in art.variants] == ["hint", "static", "static"]
    for n in (1, 2, 5):
        x = torch.randn(n, 8)
        args = [
            n if isinstance(v, torch.SymInt) else (v if v is model.w else x) for v in example_inputs
        ]
        with torch.no_grad():
            assert_close(art(*args), model(x))


class _TwoStage(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.sin()
        return (a.cos() + 1) * 2


def test_split_module_submodules_return_what_upstream_returns(tmp_path: Any) -> None:
    """``split_module`` submodules return a single value, not a tuple: so does upstream's
    artifact in the compiling process, and a list of that one value after its load
    (vLLM's load wrapper takes ``[0]`` of it). Ours return exactly that, and the graph's
    own structure after a load with ``output_structure="graph"``; the pieces chain."""
    from conftest import capture
    from torch._inductor.utils import fresh_cache
    from torch.fx.passes.split_module import split_module

    captured = capture(_TwoStage(), torch.randn(4, 3))
    stage = {"part": 0}

    def part(node: torch.fx.Node) -> int:
        if node.name == "cos":
            stage["part"] = 1
        return stage["part"]

    parts = split_module(captured.gm, None, part, keep_original_order=True)
    x = torch.randn(6, 3)
    value: Any = x
    for name in ("submod_0", "submod_1"):
        sub = getattr(parts, name)
        examples = [n.meta["example_value"] for n in sub.graph.nodes if n.op == "placeholder"]
        args = [value, 3, 6]  # the piece's input, then its SymInts (s27, s77)
        upstream = torch._inductor.standalone_compile(
            sub, examples, dynamic_shapes="from_graph", options={}
        )
        ours = precompile.standalone_compile(sub, examples, cache=False)
        expected = upstream(*args)
        assert isinstance(expected, torch.Tensor)
        result = ours(*args)
        assert isinstance(result, torch.Tensor)
        torch.testing.assert_close(result, expected)
        path = os.path.join(str(tmp_path), f"{name}.pt2c")
        ours.save(path=path)
        reloaded = precompile.CompiledArtifact.load(path=path)(*args)
        upstream_path = os.path.join(str(tmp_path), f"{name}.upstream.bin")
        upstream.save(path=upstream_path)
        with fresh_cache():
            upstream_reloaded = torch._inductor.CompiledArtifact.load(path=upstream_path)(*args)
        assert type(upstream_reloaded) is list and len(upstream_reloaded) == 1
        assert type(reloaded) is list and len(reloaded) == 1
        torch.testing.assert_close(reloaded[0], upstream_reloaded[0])
        as_graph = precompile.CompiledArtifact.load(path=path, output_structure="graph")(*args)
        assert isinstance(as_graph, torch.Tensor)
        torch.testing.assert_close(as_graph, expected)
        value = result
    torch.testing.assert_close(value, _TwoStage()(x))


def test_readme_backend_example_serves_batch_size_one() -> None:
    """Dynamo hands the backend a static graph for the first call at batch 1 (its 0/1
    specialization): the hints meant for dynamic graphs do not apply, one variant does."""
    from demo import MLP

    torch.manual_seed(0)
    model = MLP(width=32, hidden=64).eval()
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        art = precompile.standalone_compile(
            gm, example_inputs, dynamic_shapes="from_tracing_context", hints=[16, 256]
        )
        seen.append(len(art.variants))
        return art

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for n in (1, 1, 5, 9):
            x = torch.randn(n, 32)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert seen[0] == 1  # the static batch-1 graph
    assert seen[-1] == 2  # the dynamic graph Dynamo compiles when the batch changes


def test_compiled_with_grad_enabled_the_artifact_trains() -> None:
    """Compiled with grad enabled, the variants carry a backward graph: gradients match
    eager's, and an input whose requires_grad differs from the compile's is refused
    (its gradient would silently be missing)."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ self.w).sum(1)

    torch.manual_seed(0)
    model = Scaled()
    box: dict[str, Any] = {}

    def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        box["gm"], box["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(5, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(model, backend=keep, fullgraph=True)(x)
    art = precompile.standalone_compile(box["gm"], box["inputs"], hints=[4, 64], cache=False)
    assert art.manifest.training
    for n in (3, 100):
        x = torch.randn(n, 8)
        args = [
            n if isinstance(v, torch.SymInt) else (model.w if v is model.w else x)
            for v in box["inputs"]
        ]
        model.w.grad = None
        art(*args)[0].sum().backward()
        ours = model.w.grad.clone()
        model.w.grad = None
        model(x).sum().backward()
        torch.testing.assert_close(ours, model.w.grad)
    x = torch.randn(3, 8, requires_grad=True)  # compiled for an x that needs no grad
    args = [
        3 if isinstance(v, torch.SymInt) else (model.w if v is model.w else x)
        for v in box["inputs"]
    ]
    with pytest.raises(precompile.InputMismatchError, match="requires_grad=True"):
        art(*args)


def test_a_graph_inductor_cannot_compile_fails_once_with_the_reason(
    mlp: Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo retries a failing backend on every call: the first compile says why, and
    later calls fail at once instead of compiling (and failing) again."""
    import torch._inductor.compile_fx as compile_fx

    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("lowering exploded\\nsecond line of a long trace")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    captured = mlp.captured
    for attempt in range(3):
        with pytest.raises(precompile.UnsupportedGraphError) as info:
            precompile.standalone_compile(
                captured.gm, captured.example_inputs, hints=[7, 77], cache=False
            )
        assert "could not compile variant 0 (hint s" in str(info.value)
        assert "RuntimeError: lowering exploded" in str(info.value)
        assert ("not retried" in str(info.value)) == (attempt > 0)
    assert len(calls) == 1


def test_a_hint_variant_with_a_backward_graph_serves_other_sizes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Causal attention compiled with grad enabled: size-oblivious tracing of its backward
    held the hint variant to its hint (``12 == s``, every other size NoVariantError, found
    by the tensor-parallel work), and where it did not, baked the saved activations'
    strides at the hint into the backward. A graph with a backward is traced with 0/1
    guards: forward and gradients equal eager's at other sizes."""
    from conftest import AttentionBlock

    torch.manual_seed(0)
    block = AttentionBlock()
    with caplog.at_level("INFO", logger="precompile"):
        compiled = precompile.compile_model(
            block, (torch.randn(1, 8, 32),), dynamic={0: [1]}, hints=[12], warmup=False,
            cache=False,
        )  # fmt: skip
    hint = next(v for v in compiled.artifact.manifest.variants if v.kind == "hint")
    assert not any("==" in guard for guard in hint.guards), hint.guards
    assert "held a dynamic dim to one size" not in caplog.text  # no retry was needed
    for length in (5, 12, 40):
        x = torch.randn(1, length, 32)
        got, want = compiled(x), block(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ours = torch.autograd.grad(got.square().sum(), list(block.parameters()))
        eager = torch.autograd.grad(want.square().sum(), list(block.parameters()))
        for a, b in zip(ours, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_hints_for_a_graph_with_no_dynamic_dims_say_so(caplog: Any) -> None:
    """int() of a SymInt fixes that size in the caller's graph (Dynamo's ShapeEnv records
    it): the graph is then static, and hints given for it are said to be unused, not
    silently dropped."""
    import logging

    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    x = torch.randn(4, 8)
    gm, example_inputs = precompile.capture_graph(model, x, dynamic=True)
    assert [int(v) for v in example_inputs if isinstance(v, torch.SymInt)] == [4]
    with caplog.at_level(logging.WARNING, logger="precompile"), torch.no_grad():
        art = precompile.standalone_compile(gm, example_inputs, hints=[1, 16], cache=False)
    assert len(art.variants) == 1 and not art.symbols
    assert "no dynamic dims" in caplog.text, caplog.text


def test_a_custom_pass_that_cannot_be_saved_is_named() -> None:
    """A plain function as a post-grad pass compiles, but AOTAutograd will not cache a
    graph compiled with it, so nothing can be saved: the error names the pass and what
    it must be, where it blamed torch.export's wrapper (a client trial)."""

    class Silu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x) * 2

    def keep(graph: torch.fx.Graph) -> None:
        return None

    options = {"config_patches": {"post_grad_custom_post_pass": keep}}
    with pytest.raises(precompile.UnsupportedGraphError, match="CustomGraphPass whose uuid") as err:
        precompile.compile_model(
            Silu(), (torch.randn(4, 8),), dynamic={0: [0]}, hints=[8], cache=False,
            options=options,
        )  # fmt: skip
    assert "Unsupported post grad custom pass" in str(err.value)
    assert "torch.export" not in str(err.value)
