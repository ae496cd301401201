"""Random ops (dropout in ``train()`` mode, ``torch.rand``) draw as eager draws them: under
one ``torch.manual_seed`` a compiled call gives eager's values bit for bit and leaves the
generator where eager leaves it (values to float rounding), first calls at new sizes
included, and nothing the
library runs for itself (a warm-up, a build-time check, calibration) moves the caller's
generator. Which nodes draw is read from the trace (``precompile._random_policy``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import capture, run_python

import precompile
from precompile._random_policy import draws_random, graph_draws_random

SIZES = (3, 3, 5, 1, 12, 40)


class Noisy(torch.nn.Module):
    """Dropout, ``rand_like`` and ``randn`` of a dynamic size in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.dropout = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(self.linear(x))
        return y + torch.rand_like(y) + torch.randn(y.shape[0], 1)


def _eager_and_compiled(model: torch.nn.Module, call: Any, n: int) -> tuple[bool, bool]:
    """Whether ``call`` gives eager's values at ``n`` rows under one seed, and leaves the
    generator where eager leaves it. Values to float rounding: the trace at 1 row
    computes the linear layer in another order (2e-7 off, as ``torch.compile``'s does);
    a draw that differs is off by up to the values' own size."""
    x = torch.randn(n, 16)
    torch.manual_seed(11)
    expected, after_eager = model(x), torch.rand(4)
    torch.manual_seed(11)
    got, after = call(x), torch.rand(4)
    close = torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    return close, torch.equal(after, after_eager)


@pytest.fixture(scope="module")
def noisy_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("random-store"))


def test_compiled_random_ops_give_eagers_values_at_every_size(noisy_store: str) -> None:
    """Before, inductor's own random numbers differed from eager's (max 4.1 on this
    model), and the build's background warm-up drew from the caller's generator while
    the first calls ran (their values moved even once inductor drew as eager)."""
    torch.manual_seed(0)
    model = Noisy().train()
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randn(8, 16),), dynamic={0: [0]}, hints=[4, 16], cache=noisy_store
        )
        for n in SIZES:
            assert _eager_and_compiled(model, compiled, n) == (True, True), n


def test_a_fresh_process_draws_as_eager_from_its_first_call(noisy_store: str) -> None:
    """The same model loaded warm (its variants loaded by the warm-up thread, none run)."""
    out = run_python(
        f"""
        import sys
        sys.path.insert(0, "tests"); sys.path.insert(0, "tests/compile")
        import torch, precompile
        from test_random_ops import Noisy, _eager_and_compiled, SIZES
        torch.manual_seed(0)
        model = Noisy().train()
        with torch.no_grad():
            compiled = precompile.compile_model(model, (torch.randn(8, 16),),
                dynamic={{0: [0]}}, hints=[4, 16], cache={noisy_store!r})
            print([_eager_and_compiled(model, compiled, n) for n in SIZES])
        """
    )
    assert out.strip().splitlines()[-1] == str([(True, True)] * len(SIZES))


def test_the_manifest_says_whether_a_graph_draws(caplog: pytest.LogCaptureFixture) -> None:
    """A graph that draws is never run by warm-up (only loaded) and never calibrated on
    the caller's generator; one whose dropout is off (``eval()``) is like any other."""
    torch.manual_seed(0)
    for train in (True, False):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.3)).train(train)
        captured = capture(model, torch.randn(6, 16))
        with torch.no_grad():
            artifact = precompile.standalone_compile(
                captured.gm, captured.example_inputs, hints=[4], cache=False
            )
        assert artifact.manifest.draws_random is train
        assert ("draws_random" in artifact.manifest.to_json()) is train
    model = Noisy().train()
    captured = capture(model, torch.randn(6, 16))
    with torch.no_grad():
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[4, 16], cache=False
        )
        x = torch.randn(6, 16)
        flat = captured.flat(x)  # type: ignore[attr-defined]
        with caplog.at_level(logging.INFO, logger="precompile"):
            artifact.warmup(inputs=flat)
        assert "ran none: the graph draws from the caller's generator" in caplog.text
        torch.manual_seed(3)
        before = torch.rand(4)
        torch.manual_seed(3)
        artifact.calibrate([5, 12], inputs=flat, warmup=1, reps=2, rounds=1)
        assert torch.equal(torch.rand(4), before)


def test_a_callers_option_keeps_inductors_own_random_numbers() -> None:
    """``fallback_random`` in the options is the caller's choice, applied inside the
    compile: inductor's own random numbers then, not eager's."""
    torch.manual_seed(0)
    model = Noisy().train()
    captured = capture(model, torch.randn(6, 16))
    with torch.no_grad():
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, cache=False,
            options={"config_patches": {"fallback_random": False}},
        )  # fmt: skip
        x = torch.randn(6, 16)
        torch.manual_seed(11)
        expected = model(x)
        torch.manual_seed(11)
        got = artifact(*captured.flat(x))[0]  # type: ignore[attr-defined]
    assert not torch.equal(got, expected)


class _Calls(torch.nn.Module):
    def __init__(self, body: Any) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "draws"),
    [
        (lambda x: torch.nn.functional.dropout(x, 0.5, True), True),
        (lambda x: torch.nn.functional.dropout(x, 0.5, False), False),
        (lambda x: torch.nn.functional.dropout(x, 0.0, True), False),
        (lambda x: torch.dropout(x, 0.5, True), True),
        (lambda x: torch.dropout(x, 0.5, False), False),
        (lambda x: torch.rand_like(x), True),
        (lambda x: x.bernoulli_(0.5), True),
        (lambda x: x.uniform_(), True),
        (lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.1), True),
        (lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x), False),
        (lambda x: torch.nn.functional.relu(x) + x.sum(), False),
    ],
)
def test_which_nodes_draw(body: Any, draws: bool) -> None:
    gm = torch.fx.symbolic_trace(_Calls(body))
    assert graph_draws_random(gm) is draws
    assert any(draws_random(n) for n in gm.graph.nodes) is draws


def test_a_transformers_model_in_eval_mode_does_not_draw() -> None:
    """GPT-2 keeps ``nn.Dropout`` modules and passes attention a dropout probability that
    is 0 outside training: nothing there draws, so its warm-up runs as before."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (1, 8))
    for train, draws in ((False, False), (True, True)):
        gm, _ = precompile.capture_graph(model.train(train), ids)
        assert graph_draws_random(gm) is draws, train


def test_a_model_whose_trace_draws_otherwise_is_refused() -> None:
    """A tiny Llama in ``train()`` mode with attention dropout: called without a KV cache
    it draws as eager (served, eager's logits); over a StaticCache its trace took another
    attention kernel than eager, whose dropout mask differs (0.64 relative error): refused
    at build, naming why, where its outputs (and ``generate``'s tokens) differed before."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
        attention_dropout=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(1, 512, (1, 7))
    with torch.no_grad():
        # lengths of 2 and more, the lengths called below: one trace
        compiled = precompile.compile_model(
            model, (ids,), {"use_cache": False}, dynamic={0: {1: (2, None)}}, hints=[8],
            cache=False,
        )  # fmt: skip
        for n in (7, 12):
            x = torch.randint(1, 512, (1, n))
            torch.manual_seed(4)
            expected = model(x, use_cache=False).logits
            torch.manual_seed(4)
            got = compiled(x, use_cache=False).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        kv_cache = transformers.StaticCache(config=config, max_cache_len=32)
        torch.manual_seed(9)
        before = torch.rand(4)
        torch.manual_seed(9)
        with pytest.raises(precompile.UnsupportedGraphError, match="draws random numbers"):
            precompile.compile_model(model, (ids,), {"past_key_values": kv_cache},
                                     dynamic={0: [1]}, hints=[8], cache=False)  # fmt: skip
        assert torch.equal(torch.rand(4), before)  # the build drew from forked generators


def test_a_compiled_call_that_moves_the_generator_otherwise_is_refused() -> None:
    """Dropout at p=1 draws nothing in eager and draws once compiled (upstream's lowering
    with fallback_random does too): equal outputs, but the generator left elsewhere. The
    build compares the generators too (a client trial found it: the caller's next mask
    differed by 2.0)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(1.0)).train()
    with torch.no_grad(), pytest.raises(precompile.UnsupportedGraphError,
                                        match="leaves the random generator elsewhere"):  # fmt: skip
        precompile.compile_model(model, (torch.randn(6, 16),), dynamic={0: [0]}, hints=[4],
                                 cache=False)  # fmt: skip


@pytest.mark.parametrize("value", [0, "False", None, 1])
def test_the_opt_out_takes_true_or_false_only(value: object) -> None:
    """Inductor reads 0 as False and "False" as True: refused before any compile."""
    model = Noisy().train()
    captured = capture(model, torch.randn(6, 16))
    options = {"config_patches": {"fallback_random": value}}
    with torch.no_grad():
        with pytest.raises(precompile.InvalidOptionError, match=r"fallback_random.*True or False"):
            precompile.compile_model(model, (torch.randn(6, 16),), options=options, cache=False)
        with pytest.raises(precompile.InvalidOptionError, match=r"fallback_random.*True or False"):
            precompile.standalone_compile(captured.gm, captured.example_inputs,
                                          options=options, cache=False)  # fmt: skip


def test_compile_model_raises_its_own_errors_not_dynamos_wrapper() -> None:
    """A refusal made inside the trace's backend (here a misspelt inductor setting) is
    raised as itself, not as Dynamo's BackendCompilerFailed around it (a client trial
    found that type, which ``except precompile.InvalidOptionError`` missed)."""
    model = torch.nn.Linear(8, 8).eval()
    with torch.no_grad(), pytest.raises(precompile.InvalidOptionError, match="fallback_randm"):
        precompile.compile_model(model, (torch.randn(4, 8),), cache=False,
                                 options={"config_patches": {"fallback_randm": False}})  # fmt: skip
