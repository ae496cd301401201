"""CUDA graphs per size: replays match eager at captured, padded and uncaptured sizes,
outputs are never silently overwritten, parameters that move are noticed, and what
cannot be captured runs plainly with one warning. GPU tests are marked ``gpu``; the
option handling and the CPU fallback run everywhere."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from conftest import MLP, Compiled, capture

import precompile

cuda = pytest.mark.gpu


# -- everywhere ---------------------------------------------------------------------------
def test_options_are_validated() -> None:
    from precompile.runtime.compiler_interface import cudagraph_options

    assert cudagraph_options(None) is None and cudagraph_options(False) is None
    assert cudagraph_options(True) == precompile.CudaGraphs()
    options = cudagraph_options({"capture_sizes": [1, 2], "pad": ["s0"], "copy_outputs": False})
    assert options is not None and options.capture_sizes == (1, 2) and options.pad == ("s0",)
    for bad, message in [
        ({"bogus": 1}, "unknown options"),
        ({"max_graphs": 0}, "max_graphs must be >= 1"),
        ("yes", "must be True, False"),
    ]:
        with pytest.raises(precompile.InvalidOptionError, match=message):
            cudagraph_options(bad)  # type: ignore[arg-type]


def test_a_cpu_artifact_runs_plainly_and_says_so_once(
    mlp: Compiled, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    art = precompile.CompiledArtifact(mlp.artifact.manifest, mlp.artifact._payloads)
    with pytest.raises(precompile.InvalidOptionError, match="not symbols"):
        art.set_cudagraphs({"pad": ["nope"]})
    art.set_cudagraphs({"capture_sizes": [4, 16], "pad": [art.symbols[0].name]})
    with caplog.at_level(logging.WARNING, logger="precompile"), torch.no_grad():
        for n in (3, 5, 3):
            x = torch.randn(n, 32)
            torch.testing.assert_close(art(*mlp.captured.flat(x))[0], mlp.captured.model(x))
    assert caplog.text.count("CUDA graphs off for this artifact") == 1
    assert art.captured_sizes == ()
    # a serving-time switch leaves what is saved alone: the compile's default (off) travels
    plain = os.path.join(str(tmp_path), "switched.pt2c")
    art.save(path=plain)
    assert precompile.CompiledArtifact.load(path=plain).cudagraphs is None
    assert art.manifest.cudagraphs is None
    # save=True makes the options the default a load starts from
    art.set_cudagraphs({"capture_sizes": [4, 16], "pad": [art.symbols[0].name]}, save=True)
    path = os.path.join(str(tmp_path), "with-graphs.pt2c")
    art.save(path=path)
    loaded = precompile.CompiledArtifact.load(path=path)
    assert loaded.cudagraphs == art.cudagraphs
    assert precompile.CompiledArtifact.load(path=path, cudagraphs=False).cudagraphs is None
    # and a load's own cudagraphs= is a switch too: saving it again keeps the default
    again = os.path.join(str(tmp_path), "again.pt2c")
    precompile.CompiledArtifact.load(path=path, cudagraphs=False).save(path=again)
    assert precompile.CompiledArtifact.load(path=again).cudagraphs == art.cudagraphs


# -- on a GPU -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_mlp() -> tuple[Any, Any]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = MLP(width=64, hidden=128).cuda().eval()
    captured = capture(model, torch.randn(5, 64, device="cuda"))
    with torch.no_grad():
        art = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[4, 64], cache=False
        )
    return captured, art


def _fresh(art: Any, **options: Any) -> Any:
    graphs = precompile.CompiledArtifact(art.manifest, art._payloads)
    return graphs.set_cudagraphs(options or True)


@cuda
def test_replays_match_eager_and_plain_runs(cuda_mlp: tuple[Any, Any]) -> None:
    captured, art = cuda_mlp
    graphs = _fresh(art)
    with torch.no_grad():
        for n in (3, 3, 7, 100, 7, 1000, 3):
            x = torch.randn(n, 64, device="cuda")
            ours = graphs(*captured.flat(x))[0]
            torch.testing.assert_close(ours, captured.model(x), rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(ours, art(*captured.flat(x))[0], rtol=0, atol=0)
    assert sorted(graphs.captured_sizes) == [(3,), (7,), (100,), (1000,)]


@cuda
def test_outputs_are_never_silently_overwritten(cuda_mlp: tuple[Any, Any]) -> None:
    captured, art = cuda_mlp
    graphs = _fresh(art)
    with torch.no_grad():
        first_x, second_x = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
        first = graphs(*captured.flat(first_x))[0]
        graphs(*captured.flat(second_x))
        torch.testing.assert_close(first, captured.model(first_x), rtol=1e-3, atol=1e-3)
        # Opting out returns the pool's tensor: the next call at that size rewrites it.
        shared = _fresh(art, copy_outputs=False)
        first = shared(*captured.flat(first_x))[0]
        second = shared(*captured.flat(second_x))[0]
        assert first.data_ptr() == second.data_ptr()
        torch.testing.assert_close(first, captured.model(second_x), rtol=1e-3, atol=1e-3)


@cuda
def test_padding_replays_the_next_larger_graph(cuda_mlp: tuple[Any, Any]) -> None:
    captured, art = cuda_mlp
    symbol = art.symbols[0].name
    graphs = _fresh(art, capture_sizes=[4, 16, 64], pad=[symbol])
    templates = captured.flat(torch.randn(2, 64, device="cuda"))
    graphs.warmup(inputs=templates)
    assert sorted(graphs.captured_sizes) == [(4,), (16,), (64,)]
    with torch.no_grad():
        for n in (2, 5, 16, 33, 64, 65):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(
                graphs(*captured.flat(x))[0], captured.model(x), rtol=1e-3, atol=1e-3
            )
    # 2, 5 and 33 were padded; 65 is larger than every captured size: its own graph
    assert sorted(graphs.captured_sizes) == [(4,), (16,), (64,), (65,)]


class _RowMixing(torch.nn.Module):
    """Rows are not independent (each is centered on the mean of all rows): padding rows
    with zeros changes the result, so padding must be refused."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        return y - y.mean(0, keepdim=True)


@cuda
def test_padding_that_changes_results_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = _RowMixing().cuda().eval()
    captured = capture(model, torch.randn(6, 16, device="cuda"))
    with torch.no_grad():
        art = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[8], cache=False
        )
    graphs = _fresh(art, capture_sizes=[8, 32], pad=[art.symbols[0].name])
    with caplog.at_level(logging.WARNING, logger="precompile"):
        graphs.warmup(inputs=captured.flat(torch.randn(3, 16, device="cuda")))
    assert "padding refused" in caplog.text
    with torch.no_grad():
        for n in (5, 20):
            x = torch.randn(n, 16, device="cuda")
            torch.testing.assert_close(graphs(*captured.flat(x))[0], model(x), rtol=1e-3, atol=1e-3)


class _CpuScale(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * scale.to(x.device)


@cuda
def test_what_cannot_be_captured_runs_plainly(caplog: pytest.LogCaptureFixture) -> None:
    captured = capture(_CpuScale(), torch.randn(4, 8, device="cuda"), torch.randn(8))
    with torch.no_grad():
        art = precompile.standalone_compile(captured.gm, captured.example_inputs, cache=False)
    graphs = _fresh(art)
    with caplog.at_level(logging.WARNING, logger="precompile"), torch.no_grad():
        for n in (4, 9):
            x, scale = torch.randn(n, 8, device="cuda"), torch.randn(8)
            torch.testing.assert_close(graphs(*captured.flat(x, scale))[0], x * scale.cuda())
    assert "cpu tensor" in caplog.text and graphs.captured_sizes == ()


@cuda
def test_a_moved_parameter_is_noticed(cuda_mlp: tuple[Any, Any]) -> None:
    torch.manual_seed(1)
    model = MLP(width=64, hidden=128).cuda().eval()
    captured = capture(model, torch.randn(5, 64, device="cuda"))
    with torch.no_grad():
        art = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=False
        )
    graphs = _fresh(art)
    with torch.no_grad():
        x = torch.randn(10, 64, device="cuda")
        args = [
            torch.nn.Parameter(a.detach()) if isinstance(a, torch.Tensor) and a is not x else a
            for a in captured.flat(x)
        ]
        graphs(*args)
        moved = [
            torch.nn.Parameter(a.detach().clone() * 2) if isinstance(a, torch.nn.Parameter) else a
            for a in args
        ]
        expected = art(*moved)[0]
        torch.testing.assert_close(graphs(*moved)[0], expected, rtol=0, atol=0)
        torch.testing.assert_close(graphs(*moved)[0], expected, rtol=0, atol=0)


@cuda
def test_inside_a_torch_compile_backend() -> None:
    """Dynamo calls the artifact, the artifact replays; capture_sizes are captured at the
    first call, from its weights."""
    torch.manual_seed(0)
    model = MLP(width=64, hidden=128).cuda().eval()
    made: list[Any] = []
    inner = precompile.backend(hints=[4, 64], cache=False, cudagraphs={"capture_sizes": [8, 32]})

    def keeping(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        made.append(inner(gm, example_inputs))
        return made[-1]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=keeping, dynamic=True)
    with torch.no_grad():
        for n in (5, 8, 32, 17, 8):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-3, atol=1e-3)
    captured = sorted(made[-1].artifact.captured_sizes)
    assert (8,) in captured and (32,) in captured and (17,) in captured, captured


@cuda
def test_a_failed_capture_after_the_call_ran_does_not_run_it_again() -> None:
    """A graph that writes its inputs is captured at its second call, and the run before
    capture is that call: if capturing then fails, the call's outputs are that run's (a
    KV cache is written once), and the size runs plainly from then on."""
    from precompile.runtime._cudagraphs import CaptureFailed, _capture

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    buffer = torch.zeros(4, device="cuda")

    def step(buf: torch.Tensor) -> list[torch.Tensor]:
        buf.add_(1)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not capturable")
        return [buf * 2]

    pool = torch.cuda.graph_pool_handle()
    with pytest.raises(CaptureFailed) as failed:
        _capture(step, [buffer], pool, frozenset({0}), writes=True)
    torch.cuda.synchronize()
    assert buffer.tolist() == [1.0] * 4  # written by the one run that was the call
    assert failed.value.outputs is not None
    assert failed.value.outputs[0].tolist() == [2.0] * 4
    with pytest.raises(RuntimeError):  # a graph that writes nothing: the error itself
        _capture(step, [torch.zeros(4, device="cuda")], pool, frozenset({0}), writes=False)


class _Accumulate(torch.nn.Module):
    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(x)
        return total * 2


@cuda
def test_a_written_input_dynamo_did_not_mark_is_written_in_place() -> None:
    """A buffer the graph writes, passed as a plain tensor (no static mark: a KV cache
    first filled inside another torch.compile trace is one): replays write the caller's
    own buffer, and another buffer drops the graph, never writing the first one."""
    x = torch.randn(4, 8, device="cuda")
    captured = capture(_Accumulate(), x, torch.zeros(4, 8, device="cuda"))
    with torch.no_grad():
        art = precompile.standalone_compile(captured.gm, captured.example_inputs, cache=False)
    spec = [s for s in art.manifest.inputs if getattr(s, "mutation", "none") == "data"]
    assert len(spec) == 1 and not spec[0].static_address
    graphs = _fresh(art)
    first, second = torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8, device="cuda")
    with torch.no_grad():
        for step in range(1, 5):  # plain, captured at the 2nd call, then replays
            out = graphs(*captured.flat(x, first))[0]
            torch.testing.assert_close(first, x * step, rtol=0, atol=0)
            torch.testing.assert_close(out, x * step * 2, rtol=0, atol=0)
        assert graphs.captured_sizes, "the written buffer kept the size from being captured"
        for step in range(1, 4):  # another buffer: dropped, plain, captured again
            out = graphs(*captured.flat(x, second))[0]
            torch.testing.assert_close(second, x * step, rtol=0, atol=0)
            torch.testing.assert_close(out, x * step * 2, rtol=0, atol=0)
    torch.testing.assert_close(first, x * 4, rtol=0, atol=0)
