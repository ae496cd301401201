"""Model kinds beyond Llama and Qwen2 through ``serve_generate``, each against
transformers' own ``generate`` (the table of Whole models' model kinds): served with its
tokens, or refused before any compile with the true reason (a gap of the table)."""

from __future__ import annotations

import pytest
import torch
from tiny_models_helpers import VOCAB, tiny_decoder, tiny_encoder_decoders, tiny_opt

import precompile


def test_opt_is_served_with_transformers_tokens() -> None:
    """OPT computes its positions from the attention mask (a cumulative sum read back
    as a length: an unbacked symbol in the trace). Each variant compiles from a fresh
    ShapeEnv, where AOTAutograd's rebinding of that symbol to the trace's name failed
    ("u0 possible memo disaster") and serve_generate refused the model."""
    model = tiny_opt()
    options = dict(max_new_tokens=6, do_sample=False, cache_implementation="static",
                   pad_token_id=1)  # fmt: skip
    torch.manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (1, 7)), torch.randint(3, VOCAB, (1, 12))]
    with torch.no_grad():
        expected = [model.generate(p, **options) for p in prompts]
        vars(model).pop("_previous_max_cache_length", None)
        with precompile.serve_generate(model, hints=[8]) as served:
            got = [model.generate(p, **options) for p in prompts]
    # the compiled loop's model could not be traced at one token (its decode step):
    # refused when compiled, before any request ran on it (it raised NoVariantError at the
    # first step), and transformers' loop serves the calls on compiled forwards
    assert served.stats["fallbacks"] == {"the decode loop could not be compiled": 2}
    assert served.stats["calls"] > 0 and len(served.compiled) >= 2  # prefill and decode
    for tokens, reference in zip(got, expected, strict=True):
        assert torch.equal(tokens, reference)


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoders_are_refused_before_any_compile_with_the_true_reason(kind: str) -> None:
    """A gap, refused by name: transformers hands T5 and BART an ``EncoderDecoderCache``
    with ``cache_implementation="static"`` too, which the refusal told the caller to pass."""
    model = tiny_encoder_decoders()[kind]
    prompt = torch.randint(3, VOCAB, (1, 7))
    with torch.no_grad(), precompile.serve_generate(model, hints=[8]) as served:
        for static in (False, True):
            options = {"cache_implementation": "static"} if static else {}
            with pytest.raises(precompile.UnsupportedGraphError, match="encoder-decoder model"):
                model.generate(prompt, max_new_tokens=3, do_sample=False, **options)
    assert served.compiled == {} and served.stats["calls"] == 0


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "gpt_neox", "falcon"])
def test_decoder_kinds_are_served_on_the_compiled_loop_with_transformers_tokens(kind: str) -> None:
    """Each of these StaticCache decoders runs ``model.generate()`` on the compiled loop
    (``serve_generate``'s default), greedy, a batch of 2, with transformers' tokens."""
    model = tiny_decoder(kind)
    options = dict(max_new_tokens=4, do_sample=False, cache_implementation="static",
                   pad_token_id=0)  # fmt: skip
    torch.manual_seed(3)
    prompt = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad():
        expected = model.generate(prompt, **options)
        vars(model).pop("_previous_max_cache_length", None)
        with precompile.serve_generate(model, hints=[8], cache=False) as served:
            got = model.generate(prompt, **options)
    assert served.stats["loop_generates"] == 1 and served.stats["fallbacks"] == {}
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_caches_are_refused_before_any_compile_with_the_true_reason(
    kind: str,
) -> None:
    """A gap, refused by name: a window shorter than the cache gives the StaticCache
    sliding-window layers, which keep their length in a Python int a graph would be
    specialized to. Refused by the compiled loop and by the router alike, before a trace."""
    model = tiny_decoder(kind)
    prompt = torch.randint(3, VOCAB, (1, 7))
    served = precompile.serve_generate(model, hints=[8], cache=False)
    refused = pytest.raises(precompile.UnsupportedGraphError, match="StaticSlidingWindowLayer")
    with torch.no_grad(), served, refused:
        model.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert served.compiled == {} and served.loops is not None and served.loops.compiled == {}
    assert served.stats["fallbacks"] == {"the decode loop could not be compiled": 1}
