"""Which ``generate`` calls ``serve_generate(loop=True)`` answers on the compiled decode
loop, with transformers' effective settings, and why it leaves the others to
transformers' loop. Compiles nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_helpers import VOCAB, build

import precompile
from precompile._generate_loop import DecodeLoops, LoopRequest, loop_request

pytest.importorskip("transformers")

STATIC = {"cache_implementation": "static"}


@pytest.fixture(scope="module")
def model() -> Any:
    return build("llama")


def test_transformers_defaults_apply_as_in_generate(model: Any) -> None:
    """Sampling with nothing else set takes transformers' global top-k of 50; greedy
    passes no sampling settings; the model's EOS pads finished rows where no pad is set."""
    ids = torch.randint(0, VOCAB, (2, 5))
    sampled = loop_request(model, (ids,), {**STATIC, "max_new_tokens": 4, "do_sample": True})
    assert isinstance(sampled, LoopRequest)
    assert (sampled.top_k, sampled.top_p, sampled.temperature) == (50, None, 1.0)
    assert sampled.eos_token_id == 2 and sampled.pad_token_id == 2
    greedy = loop_request(model, (), {**STATIC, "input_ids": ids, "max_length": 9,
                                      "pad_token_id": 0, "top_p": 0.5})  # fmt: skip
    assert isinstance(greedy, LoopRequest) and greedy.max_new_tokens == 4
    assert greedy.sampling() == {"do_sample": False, "eos_token_id": 2, "pad_token_id": 0}
    assert greedy.capacity == 64 and sampled.capacity == 64
    long = loop_request(model, (ids,), {**STATIC, "max_new_tokens": 100})
    assert isinstance(long, LoopRequest) and long.capacity == 128  # 105, to a power of two


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"num_beams": 2}, "num_beams"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"min_new_tokens": 3}, "min_new_tokens"),
        ({"streamer": object()}, "option 'streamer'"),
        ({"logits_processor": []}, "option 'logits_processor'"),
        ({"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}, "attention_mask with padding"),
        ({"cache_implementation": None}, "not static"),
        ({"past_key_values": object()}, "not a StaticCache"),
        ({"past_key_values": "kv"}, "not a StaticCache"),
        ({"max_new_tokens": 0}, "settings could not be read (ValueError)"),  # as generate
    ],
)
def test_what_the_loop_does_not_implement_goes_to_transformers(
    model: Any, kwargs: dict[str, Any], reason: str
) -> None:
    ids = torch.randint(0, VOCAB, (2, 3))
    why = loop_request(model, (ids,), {**STATIC, "max_new_tokens": 4, **kwargs})
    assert isinstance(why, str) and reason in why, why


def test_a_mask_of_ones_and_a_float_prompt(model: Any) -> None:
    ids = torch.randint(0, VOCAB, (2, 3))
    mask = torch.ones(2, 3, dtype=torch.long)
    ones = loop_request(model, (ids,), {**STATIC, "max_new_tokens": 2, "attention_mask": mask})
    assert isinstance(ones, LoopRequest)
    why = loop_request(model, (ids.float(),), {**STATIC, "max_new_tokens": 2})
    assert isinstance(why, str) and "int64 tensor of token ids" in why


def test_a_static_cache_passed_with_cache_implementation_is_left_to_transformers(
    model: Any,
) -> None:
    """transformers refuses the two together; the loop must not answer what it refuses."""
    import transformers

    ids = torch.randint(0, VOCAB, (1, 3))
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    why = loop_request(model, (ids,), {**STATIC, "past_key_values": cache, "max_new_tokens": 2})
    assert isinstance(why, str) and "transformers refuses them together" in why
    used = loop_request(model, (ids,), {"past_key_values": cache, "max_new_tokens": 2})
    assert isinstance(used, LoopRequest) and used.kv_cache is cache and used.capacity == 32


def test_a_prompt_holding_the_pad_token_is_left_to_transformers(model: Any) -> None:
    """transformers masks a prompt's pad tokens where no mask is passed (a padded batch
    to it), unless the pad token is an EOS token: the loop, with no mask, would attend
    to them (tokens differed from transformers' in a docs-only client trial)."""
    ids = torch.tensor([[5, 3, 7], [9, 8, 4]])
    why = loop_request(model, (ids,), {**STATIC, "max_new_tokens": 2, "pad_token_id": 3})
    assert isinstance(why, str) and "pad token" in why, why
    as_eos = loop_request(model, (ids,), {**STATIC, "max_new_tokens": 2, "pad_token_id": 3,
                                          "eos_token_id": [2, 3]})  # fmt: skip
    assert isinstance(as_eos, LoopRequest)  # transformers infers no mask from an EOS pad
    int32 = loop_request(model, (ids.int(),), {**STATIC, "max_new_tokens": 2})
    assert isinstance(int32, str) and "int64" in int32


def test_kept_caches_follow_the_batch_a_dynamic_batch_model_serves(model: Any) -> None:
    """With ``dynamic_batch`` one compiled loop serves every batch size, but a KV cache
    holds one sequence per row: a block's kept cache of batch 1 was handed to a batch of
    2, which the loop refused, so every batch size after the first fell back."""
    loops = DecodeLoops(model, True)
    one, two = (loop_request(model, (torch.randint(3, VOCAB, (b, 4)),),
                             {**STATIC, "max_new_tokens": 2}) for b in (1, 2))  # fmt: skip
    assert isinstance(one, LoopRequest) and isinstance(two, LoopRequest)
    assert loops.key(one) == loops.key(two)
    assert loops.cache_key(one) != loops.cache_key(two)
    fixed = DecodeLoops(model, False)
    assert fixed.key(one) != fixed.key(two)


def test_a_passed_cache_too_short_is_left_to_transformers(model: Any) -> None:
    """The last new token is never fed back, so prompt + new - 1 positions are enough, as
    in eager (a docs-only client trial: a cache of exactly that length went to
    transformers' loop)."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=8)
    ids = torch.randint(3, VOCAB, (1, 6))
    why = loop_request(model, (ids,), {"past_key_values": cache, "max_new_tokens": 4})
    assert isinstance(why, str) and "shorter than the prompt" in why
    fits = loop_request(model, (ids,), {"past_key_values": cache, "max_new_tokens": 3})
    assert isinstance(fits, LoopRequest) and fits.capacity == 8


def test_blocks_on_one_model_do_not_nest(model: Any) -> None:
    """An inner block was silently ignored where the outer one had loop=True (a
    docs-only client trial): a second block on the same model is refused, naming why."""
    import precompile

    with precompile.serve_generate(model, loop=True):
        with pytest.raises(precompile.InvalidOptionError, match="do not nest"):
            precompile.serve_generate(model).__enter__()
        assert "generate" in vars(model)
    assert "generate" not in vars(model) and "forward" not in vars(model)
    with precompile.serve_generate(model):  # after the first: a block of its own
        pass


def test_no_length_given_means_transformers_default_of_new_tokens(model: Any) -> None:
    """With max_length and max_new_tokens set nowhere, transformers 5 generates its
    default 20 *new* tokens (clipped to the model's positions); the loop took 20 as the
    total and stopped 8 tokens early, with no fallback (found by a client trial)."""
    import copy

    ids = torch.randint(3, VOCAB, (1, 8))
    plain = copy.deepcopy(model)
    plain.generation_config.max_length = None
    request = loop_request(plain, (ids,), dict(STATIC))
    assert isinstance(request, LoopRequest)
    reference = plain.generate(ids, **STATIC, do_sample=False)
    assert request.max_new_tokens == reference.shape[1] - ids.shape[1] == 20
    set_total = loop_request(plain, (ids,), {**STATIC, "max_length": 20})
    assert isinstance(set_total, LoopRequest) and set_total.max_new_tokens == 12


def test_the_loop_keeps_at_most_kept_caches_free_besides_prepares(model: Any) -> None:
    """Free KV caches past ``kept_caches`` are dropped, least recently returned first;
    one a ``prepare`` made is kept whatever the bound; a kept cache comes back reset,
    to a request of its key only."""
    loops = DecodeLoops(model, dynamic_batch=False, kept_caches=1)
    one, two, three = ((b, 64, torch.int64, "cpu") for b in (1, 2, 3))
    first, second = loops.take_cache(one, 64), loops.take_cache(two, 64)
    assert first is not second and loops.kept() == 0
    first.early_initialization(1, 2, 8, torch.float32, "cpu")
    first.layers[0].cumulative_length.fill_(5)
    loops.give_back(one, first)
    assert int(first.layers[0].cumulative_length) == 0  # reset
    loops.give_back(two, second)  # past the bound: the older one goes
    assert (loops.kept(), loops.dropped) == (1, 1)
    assert loops.take_cache(one, 64) is not first and loops.take_cache(two, 64) is second
    pinned = loops.take_cache(three, 64)
    loops.give_back(three, pinned, pin=True)
    loops.give_back(two, second)
    loops.give_back(one, first)  # drops second; the pinned one stays
    assert (loops.kept(), loops.dropped) == (2, 2)
    assert loops.take_cache(three, 64) is pinned
    loops.give_back(three, pinned)  # returned by a request: still prepare's
    loops.give_back(two, second)
    assert loops.kept() == 2 and loops.take_cache(three, 64) is pinned


@pytest.mark.parametrize("bad", [-1, True, 1.5, "8", None])
def test_kept_caches_must_be_a_count(model: Any, bad: Any) -> None:
    with pytest.raises(precompile.InvalidOptionError, match="kept_caches must be a count"):
        precompile.serve_generate(model, kept_caches=bad)


def test_kept_caches_takes_any_integer(model: Any) -> None:
    numpy = pytest.importorskip("numpy")
    served = precompile.serve_generate(model, kept_caches=numpy.int64(2))
    assert served.loops is not None and served.loops.kept_caches == 2
    assert type(served.loops.kept_caches) is int
