"""Tiny random-initialized ``transformers`` models (built from small configs, nothing
downloaded) through ``precompile.backend``: outputs against eager over many sizes, with
``dynamic=True`` (Dynamo lifts the models' float attributes as inputs), with batch and
sequence dims marked dynamic, and with the KV cache on through decode steps; and a
fresh process that runs the same model from the cache with no inductor compile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import run_python
from tiny_models_helpers import SIZES, VOCAB, tiny_bert, tiny_gpt2, tiny_llama

import precompile


def _main_output(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output.last_hidden_state


def _counting(backend: Callable[..., Any], graphs: list[int]) -> Callable[..., Any]:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(len(example_inputs))
        return backend(gm, example_inputs)

    return compile_graph


# Two hint variants on Llama (dispatch between them on a real graph; the fresh-process
# test below reuses them), one on GPT-2 (the suite's time).
@pytest.mark.parametrize(
    ("name", "build", "hints"), [("llama", tiny_llama, [4, 64]), ("gpt2", tiny_gpt2, [16])]
)
def test_causal_lm_with_dynamic_true(
    name: str, build: Callable[[], torch.nn.Module], hints: list[int]
) -> None:
    """``dynamic=True`` makes Dynamo pass the models' float attributes (attention scale,
    norm epsilons) as 0-d tensors; the variants are specialized to their values."""
    model = build()
    graphs: list[int] = []
    torch._dynamo.reset()
    backend = _counting(precompile.backend(hints=hints), graphs)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for batch, seq in SIZES:
            ids = torch.randint(0, VOCAB, (batch, seq))
            torch.testing.assert_close(
                _main_output(compiled(ids, use_cache=False)),
                _main_output(model(ids, use_cache=False)),
                rtol=1e-4,
                atol=1e-4,
            )
    # a dynamic graph at batch 1, Dynamo's static one at (1, 1), a dynamic one at batch > 1
    assert len(graphs) == 3, graphs


def test_bert_with_batch_and_sequence_marked_dynamic() -> None:
    model = tiny_bert()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=precompile.backend(hints=[16]))
    torch.manual_seed(1)
    with torch.no_grad():
        for batch, seq in [(2, 9), *SIZES]:
            ids = torch.randint(0, VOCAB, (batch, seq))
            mask = torch.ones(batch, seq, dtype=torch.long)
            if (batch, seq) == (2, 9):
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(ids, 1)
                torch._dynamo.mark_dynamic(mask, 0)
                torch._dynamo.mark_dynamic(mask, 1)
            torch.testing.assert_close(
                _main_output(compiled(input_ids=ids, attention_mask=mask)),
                _main_output(model(input_ids=ids, attention_mask=mask)),
                rtol=1e-4,
                atol=1e-4,
            )


def test_llama_kv_cache_through_decode_steps() -> None:
    model = tiny_llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=precompile.backend(hints=[4, 64]))
    torch.manual_seed(2)
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (1, 5))
        ours, eager = compiled(ids, use_cache=True), model(ids, use_cache=True)
        torch.testing.assert_close(ours.logits, eager.logits, rtol=1e-4, atol=1e-4)
        for _ in range(5):
            token = torch.randint(0, VOCAB, (1, 1))
            ours = compiled(token, past_key_values=ours.past_key_values, use_cache=True)
            eager = model(token, past_key_values=eager.past_key_values, use_cache=True)
            torch.testing.assert_close(ours.logits, eager.logits, rtol=1e-4, atol=1e-4)


FRESH_LLAMA = """
import sys, torch, precompile
sys.path.insert(0, "tests")
from tiny_models_helpers import tiny_llama, VOCAB
import torch._inductor.compile_fx as compile_fx
calls = []
original = compile_fx.compile_fx
def counting(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)
compile_fx.compile_fx = counting
model = tiny_llama()
compiled = torch.compile(model, backend=precompile.backend(hints=[4, 64]), dynamic=True)
torch.manual_seed(1)
worst = 0.0
with torch.no_grad():
    for seq in (7, 30, 2):
        ids = torch.randint(0, VOCAB, (1, seq))
        diff = compiled(ids, use_cache=False).logits - model(ids, use_cache=False).logits
        worst = max(worst, diff.abs().max().item())
print("compiles", len(calls), "worst", worst)
"""


def test_a_fresh_process_runs_llama_from_the_cache_without_compiling() -> None:
    """This process fills the session's cache (in a full run the ``dynamic=True`` test
    already did); a new process with the same model and cache: Dynamo traces, inductor
    compiles nothing, outputs match eager."""
    model = tiny_llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=precompile.backend(hints=[4, 64]), dynamic=True)
    with torch.no_grad():
        for seq in (7, 30, 2):
            compiled(torch.randint(0, VOCAB, (1, seq)), use_cache=False)
    second = run_python(FRESH_LLAMA)
    assert "compiles 0 " in second, second
    worst = float(second.split("worst")[1])
    assert worst < 1e-4, second
