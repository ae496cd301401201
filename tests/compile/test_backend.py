"""Used inside a torch.compile backend: outputs, recompiles, and the caller's guards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
import torch
from conftest import MLP

import precompile


def _compile_with(kind: str, calls: list[int]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        env = torch._guards.TracingContext.get().fake_mode.shape_env
        before = {str(g.expr) for g in env.guards}
        if kind == "upstream":
            art: Callable[..., Any] = torch._inductor.standalone_compile(
                gm, example_inputs, dynamic_shapes="from_tracing_context"
            )
        else:
            art = precompile.standalone_compile(
                gm, example_inputs, dynamic_shapes="from_tracing_context", hints=[4, 64]
            )
        added = {str(g.expr) for g in env.guards} - before
        calls.append(len(added))
        return art

    return backend


def test_backend_adds_no_more_guards_than_upstream_and_never_recompiles() -> None:
    torch.manual_seed(0)
    model = MLP(width=32, hidden=64).eval()
    added: dict[str, list[int]] = {}
    for kind in ("upstream", "ours"):
        torch._dynamo.reset()
        added[kind] = []
        compiled = torch.compile(model, backend=_compile_with(kind, added[kind]), dynamic=True)
        with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
            for n in [5, 2, 9, 64, 100, 333]:
                x = torch.randn(n, 32)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        assert len(added[kind]) == 1, f"{kind}: the backend ran {len(added[kind])} times"
    assert added["ours"][0] <= added["upstream"][0]


def test_only_guards_common_to_all_hint_variants_reach_the_caller() -> None:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from precompile._graph import GraphDescription
    from precompile._standalone import _common_guards, _propagate_common_guards
    from precompile._variant_plan import VariantRequest

    env = ShapeEnv()
    s0 = env.create_symbol(8, ConstantSource("s0"), dynamic_dim=DimDynamic.DYNAMIC)
    graph = GraphDescription((), (s0,), {s0: 8}, {s0: (0, None)}, env)
    common = sympy.Lt(s0 * 4096, 2**31)
    requests = [
        VariantRequest("hint", (4,)),
        VariantRequest("hint", (64,)),
        VariantRequest("static", (3,)),
    ]
    guards = [
        (common, sympy.Ne(s0, 1)),  # hint-specific guard: must not leak
        (common,),
        (sympy.Eq(s0, 3),),
    ]
    before = len(env.guards)
    _propagate_common_guards(graph, _common_guards(graph, requests, guards))
    added = [g.expr for g in env.guards[before:]]
    assert added == [common]


def test_common_guard_false_at_a_static_size_is_not_propagated() -> None:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from precompile._graph import GraphDescription
    from precompile._standalone import _common_guards, _propagate_common_guards
    from precompile._variant_plan import VariantRequest

    env = ShapeEnv()
    s0 = env.create_symbol(8, ConstantSource("s0"), dynamic_dim=DimDynamic.DYNAMIC)
    graph = GraphDescription((), (s0,), {s0: 8}, {s0: (0, None)}, env)
    requests = [VariantRequest("hint", (8,)), VariantRequest("static", (5000,))]
    guards = [(sympy.Le(s0, 4096),), (sympy.Eq(s0, 5000),)]
    before = len(env.guards)
    _propagate_common_guards(graph, _common_guards(graph, requests, guards))
    assert len(env.guards) == before  # the static variant serves 5000: Dynamo must call us


def test_a_cache_root_that_is_a_file(tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    """A cache root that cannot be a cache is refused when the cache is opened, saying
    what is wrong (not "unsafe"). Inside torch.compile the model still compiles, uncached,
    with a warning naming the setting (``backend(cache=...)`` or $PRECOMPILE_CACHE_DIR);
    with ``compile=False`` nothing could be found or built, and the error says why."""
    import logging

    import pytest

    from precompile.cache import ArtifactCache

    path = tmp_path / "a-file"
    path.write_text("not a cache")
    with pytest.raises(precompile.CacheRootError, match="is not a directory") as caught:
        ArtifactCache(str(path))
    assert isinstance(caught.value, NotADirectoryError)
    torch.manual_seed(0)
    model = MLP(width=8, hidden=16).eval()
    x = torch.randn(3, 8)
    for cache, setting in ((str(path), "precompile.backend(cache="),
                           (None, "PRECOMPILE_CACHE_DIR=")):  # fmt: skip
        if cache is None:
            monkeypatch.setenv("PRECOMPILE_CACHE_DIR", str(path))
        torch._dynamo.reset()
        caplog.clear()
        compiled = torch.compile(model, backend=precompile.backend(cache=cache))
        with caplog.at_level(logging.WARNING, logger="precompile"), torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        assert any(setting in r.getMessage() and "without a cache" in r.getMessage()
                   for r in caplog.records), caplog.text  # fmt: skip
    torch._dynamo.reset()
    offline = torch.compile(model, backend=precompile.backend(cache=str(path), compile=False))
    with pytest.raises(Exception, match="is not a directory"), torch.no_grad():
        offline(x)
    torch._dynamo.reset()


def _serve(
    model: Any, cache: str, order: list[int], *, compile: bool, dynamic: bool | None
) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=dynamic,
                             backend=precompile.backend(hints=[4, 64], cache=cache,
                                                        compile=compile))  # fmt: skip
    with torch.no_grad():
        for batch in order:
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), model(x))


def test_a_warm_start_does_not_depend_on_the_order_of_requests(tmp_path: Any, caplog: Any) -> None:
    """With ``torch.compile(dynamic=True)`` a server finds what the build compiled
    whatever sizes come first (both orders, ``compile=False``). With Dynamo's default
    (the first trace static, at the first call's sizes) the build warns, and a server's
    miss says what to pass."""
    import logging

    import pytest

    import precompile._backend as backend_module

    torch.manual_seed(0)
    model = MLP(width=8, hidden=16).eval()
    for build, served in (([1, 4], [5, 1, 7]), ([5, 1], [1, 4, 9])):
        cache = str(tmp_path / f"dynamic-{build[0]}")
        _serve(model, cache, build, compile=True, dynamic=True)
        _serve(model, cache, served, compile=False, dynamic=True)
    cache = str(tmp_path / "default")
    backend_module._warned_static = False
    with caplog.at_level(logging.WARNING, logger="precompile"):
        _serve(model, cache, [1, 4], compile=True, dynamic=None)
    assert "dynamic=True" in caplog.text, caplog.text
    with pytest.raises(Exception, match="dynamic=True") as caught:
        _serve(model, cache, [5], compile=False, dynamic=None)
    assert "ArtifactNotFoundError" in repr(caught.value) or isinstance(
        caught.value.__cause__, precompile.ArtifactNotFoundError
    ), repr(caught.value)
    torch._dynamo.reset()
