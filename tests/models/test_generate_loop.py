"""``serve_generate`` (``loop=True``, the default): ``model.generate()`` answered by the
compiled decode loop, tokens identical to transformers' own ``generate`` (greedy with rows
stopping at EOS, sampled with torch's default generator seeded alike), in any grad mode,
no forward of transformers' loop run, one compile per KV cache length bucket; what the
loop does not implement runs on transformers' loop, its reason counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_helpers import VOCAB, build

import precompile

transformers = pytest.importorskip("transformers")


def test_generate_runs_on_the_compiled_loop_with_transformers_tokens(tmp_path: Any) -> None:
    model = build("llama")
    torch.manual_seed(21)
    prompt, shorter = torch.randint(3, VOCAB, (3, 7)), torch.randint(3, VOCAB, (3, 5))
    static = {"cache_implementation": "static", "pad_token_id": 0}
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=12, do_sample=False, **static)
        eos = int(plain[0, 7 + 3])  # row 0 stops after 4 new tokens
        greedy = {**static, "max_new_tokens": 12, "do_sample": False, "eos_token_id": eos}
        sampled = {**static, "max_new_tokens": 10, "do_sample": True, "temperature": 0.8,
                   "top_p": 0.9}  # top-k: transformers' default of 50  # fmt: skip
        want_greedy = model.generate(prompt, **greedy)
        torch.manual_seed(5)
        want_sampled = model.generate(shorter, **sampled)
        # the compiled loop: serve_generate's default
        with precompile.serve_generate(model, hints=[8], cache=str(tmp_path)) as served:
            got_greedy = model.generate(prompt, **greedy)
            # refused before transformers hooks the model to capture them (its hooks stay,
            # and a hooked model is refused by the compiled loop: every later request
            # went to transformers' loop)
            with pytest.raises(precompile.UnsupportedGraphError, match="output_attentions"):
                model.generate(prompt, output_attentions=True, return_dict_in_generate=True,
                               **greedy)  # fmt: skip
            with torch.enable_grad():  # transformers' generate runs under no_grad: so does the loop
                got_with_grad = model.generate(prompt, **greedy)
                assert torch.is_grad_enabled()  # the caller's mode, as it was
            torch.manual_seed(5)
            got_sampled = model.generate(shorter, **sampled)  # the same cache length bucket
            passed = transformers.StaticCache(config=model.config, max_cache_len=64)
            own = {k: v for k, v in greedy.items() if k != "cache_implementation"}
            got_passed = model.generate(prompt, past_key_values=passed, **own)  # used as is
            with pytest.raises(precompile.UnsupportedGraphError, match="cache_implementation"):
                model.generate(prompt, max_new_tokens=2, pad_token_id=0)  # a growing cache
        stats = served.stats
    assert torch.equal(got_greedy, want_greedy) and (got_greedy[0, 11:] == 0).all()
    assert torch.equal(got_sampled, want_sampled) and torch.equal(got_passed, want_greedy)
    assert torch.equal(got_with_grad, want_greedy)
    assert stats["loop_generates"] == 4 and stats["calls"] == 0  # no forward of the router
    assert len(served.loops.compiled) == 1  # one bucket (64), batch 3
    assert stats["fallbacks"].pop("option 'output_attentions'") == 1
    (why,) = stats["fallbacks"]
    assert "not static" in why and stats["fallbacks"][why] == 1
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "generate" not in vars(model) and "forward" not in vars(model)


def test_a_prepared_server_answers_on_the_loop_and_compiles_nothing_in_front(
    tmp_path: Any,
) -> None:
    """``served.prepare`` on the default route builds (or loads) the compiled loop the
    declared shapes run; afterwards such a request compiles nothing (counted), runs on
    the loop with transformers' tokens, and an undeclared batch is refused with
    ``compile_others=False``; the caller's generator is left alone; the KV cache prepare
    made is kept whatever ``kept_caches`` says."""
    from precompile import _variant_compile

    model = build("llama")
    options = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static",
               "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(8)
    prompt = torch.randint(3, VOCAB, (2, 5))
    compiles: list[int] = []
    real = _variant_compile.compile_variant

    def counted(*args: Any, **kwargs: Any) -> Any:
        compiles.append(1)
        return real(*args, **kwargs)

    with torch.no_grad():
        want = model.generate(prompt, **options)
        vars(model).pop("_previous_max_cache_length", None)
        state = torch.random.get_rng_state()
        with (
            # no free cache kept but prepare's: its shape never allocates in front
            precompile.serve_generate(
                model, hints=[8], cache=str(tmp_path), kept_caches=0
            ) as served,
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr(_variant_compile, "compile_variant", counted)
            ready = served.prepare([2], [5], compile_others=False, **options)
            assert torch.equal(torch.random.get_rng_state(), state) and ready.structures >= 1
            compiles.clear()
            got = model.generate(prompt, **options)
            assert compiles == [] and served.stats["unprepared_compiles"] == 0
            with pytest.raises(precompile.ArtifactNotFoundError, match="not among the prepared"):
                model.generate(torch.randint(3, VOCAB, (3, 5)), **options)
            stats = served.stats
    assert torch.equal(got, want)
    assert stats["loop_generates"] == 1 and stats["calls"] == 0
    assert stats["kept_caches"] == 1 and stats["dropped_caches"] == 0  # prepare's, pinned


@pytest.mark.gpu
def test_dropped_caches_and_their_step_graphs_give_eager_tokens_on_the_gpu(
    tmp_path: Any,
) -> None:
    """With CUDA graphs each kept cache has its step graph, keyed by the cache's
    addresses; with ``kept_caches=1`` every other request drops one and allocates
    another, which the allocator may place where a dropped one was (so an old graph's
    key matches): tokens stay eager's, batch after batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = build("llama").to(device="cuda")  # float32: eager's tokens, not a rounding's
    options = {"max_new_tokens": 12, "do_sample": False, "cache_implementation": "static",
               "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (b, 6), device="cuda") for b in (1, 2, 1, 2, 1)]
    with torch.no_grad():
        want = []
        for prompt in prompts:
            want.append(model.generate(prompt, **options))
            vars(model).pop("_previous_max_cache_length", None)
        with precompile.serve_generate(model, hints=[8], cache=str(tmp_path), cudagraphs=True,
                                       kept_caches=1) as served:  # fmt: skip
            got = [model.generate(prompt, **options) for prompt in prompts]
    for expected, answer in zip(want, got, strict=True):
        assert torch.equal(answer, expected)
    stats = served.stats
    assert stats["loop_generates"] == 5 and stats["fallbacks"] == {}
    assert stats["kept_caches"] == 1 and stats["dropped_caches"] == 4
