"""The decode loop at the model level: prefill, then token-by-token decode against a
transformers ``StaticCache``, served by ``compile_model`` (a hand-written loop) and by
``serve_generate`` (``model.generate``), tokens identical to eager for 32 greedy steps on
a tiny Llama and a tiny Qwen2 (biased q/k/v projections); batch sizes 1..8 from one
compile; a fresh process that loads the model and runs a new cache with no Dynamo frame
and no compile; and every bad cache refused with ``InputMismatchError`` naming it."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import ROOT, run_python
from decode_helpers import MAX_CACHE, STEPS, VOCAB, build, greedy, new_cache
from warm_start_helpers import AUDIT, COUNTED

import precompile

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("decode-cache"))


# Llama: batch and sequence dynamic (the cache's batch follows), cache_position passed
# (checked against the cache).
@pytest.fixture(scope="module")
def llama(cache_dir: str) -> tuple[Any, Any]:
    model = build("llama")
    ids = torch.randint(0, VOCAB, (2, 7))
    call = {"input_ids": ids, "past_key_values": new_cache(model), "use_cache": True,
            "cache_position": torch.arange(7)}  # fmt: skip
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (), call, dynamic={"input_ids": [0, 1]},
            hints={("input_ids", 0): [8], ("input_ids", 1): [8]},  # 1: traced apart
            sizes=[],
            cache=cache_dir,
        )  # fmt: skip
    assert int(call["past_key_values"].layers[0].cumulative_length) == 0  # compiling wrote nothing
    return model, compiled


@pytest.fixture(scope="module")
def qwen2(cache_dir: str) -> tuple[Any, Any]:
    model = build("qwen2")
    call = {"input_ids": torch.randint(0, VOCAB, (1, 7)), "past_key_values": new_cache(model),
            "use_cache": True}  # fmt: skip
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (), call, dynamic={"input_ids": [1]}, hints=[8], cache=cache_dir
        )
    return model, compiled


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hand_written_loop_matches_eager(arch: str, request: pytest.FixtureRequest) -> None:
    model, compiled = request.getfixturevalue(arch)
    positions = arch == "llama"
    for seed, length in ((1, 7), (2, 13)):
        torch.manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (1, length))
        eager = greedy(model, model, prompt)
        assert torch.equal(greedy(compiled, model, prompt, positions), eager)


def test_batches_one_to_eight_from_one_compile(llama: tuple[Any, Any]) -> None:
    model, compiled = llama
    torch.manual_seed(3)
    for batch in (1, 3, 8):
        prompt = torch.randint(0, VOCAB, (batch, 5))
        assert torch.equal(greedy(compiled, model, prompt, True), greedy(model, model, prompt))
    # (batch, sequence) at 2 or more: one hint point; batch 1, one-token decode steps and
    # both are traces of their own (as Dynamo would trace them), compiled into the model
    assert sorted(tuple(v.point.values()) for v in compiled.artifact.variants) == [(8, 8)]
    assert sorted(sorted(ones) for ones in compiled.pieces) == [[0], [0, 1], [1]]


def test_batch_one_steps_pass_the_fast_input_check(
    llama: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trace at batch 1 (a piece) was made from a slice of the example call, its
    input_ids strided (7, 1); a dim of size 1 is never stepped along, so its stride is no
    part of the contract: batch-1 steps pass the fast check (the C++ guard after the
    first), not the slow path, whose host time made batch-1 GPU steps host-bound."""
    model, compiled = llama
    cache = new_cache(model)
    prompt = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        out = compiled(input_ids=prompt, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(5))  # fmt: skip
        step = {"past_key_values": cache, "use_cache": True}
        leaves = compiled._leaves((), {"input_ids": prompt[:, :1], **step,
                                       "cache_position": torch.arange(1)})  # fmt: skip
        serving = compiled._serving(leaves)
        assert serving is not compiled  # the batch-1 piece
        ids_spec = serving.artifact.manifest.inputs[0]
        assert ids_spec.shape == (1, 1) and ids_spec.stride == (7, 1)
        contract = serving.artifact._contract
        slow: list[object] = []
        real = contract._coerce
        monkeypatch.setattr(contract, "_coerce", lambda *a: slow.append(a) or real(*a))
        for position in range(5, 9):
            ids = out.logits[:, -1:].argmax(-1)
            assert ids.stride() == (1, 1)
            out = compiled(input_ids=ids, cache_position=torch.tensor([position]), **step)
    assert slow == []
    assert "GUARD" in contract.read_key.__code__.co_names


def test_explain_leaves_a_fresh_cache_fresh(llama: tuple[Any, Any]) -> None:
    """``explain`` with a fresh ``StaticCache`` (the first call initializes it) says what
    that call runs, and writes nothing: before, it refused the cache's missing tensors
    ("should be a float32 tensor on cpu, got NoneType")."""
    model, compiled = llama
    fresh = new_cache(model)
    call = {"input_ids": torch.randint(0, VOCAB, (3, 5)), "use_cache": True,
            "cache_position": torch.arange(5)}  # fmt: skip
    explained = str(compiled.explain(**call, past_key_values=fresh))
    assert "s" in explained and "variant" in explained, explained
    assert not any(layer.is_initialized for layer in fresh.layers)
    with torch.no_grad():
        compiled(**call, past_key_values=fresh)
    assert int(fresh.layers[0].cumulative_length) == 5
    fresh.reset()  # initialized and empty: what the copy was
    assert str(compiled.explain(**call, past_key_values=fresh)) == explained


def test_bad_caches_are_refused_naming_what_differs(llama: tuple[Any, Any]) -> None:
    model, compiled = llama
    one = torch.zeros(1, 1, dtype=torch.long)

    def refused(match: str, cache: Any, ids: torch.Tensor = one, **extra: Any) -> None:
        call = {"cache_position": torch.arange(ids.shape[1]), **extra}
        with torch.no_grad(), pytest.raises(precompile.InputMismatchError, match=match):
            compiled(input_ids=ids, past_key_values=cache, use_cache=True, **call)

    refused("max_cache_len 32, but the model was compiled for 64", new_cache(model, length=32))
    refused(  # the call's batch is 1: served by the trace at batch 1, whose cache has 1
        "batch size 2, but the model was compiled for 1", new_cache(model, 2)
    )
    refused("dtype float64, but the model was compiled for float32",
            new_cache(model, 1, dtype=torch.float64))  # fmt: skip
    refused("device meta", new_cache(model, 1, device="meta"))
    deeper = transformers.StaticCache(
        config=transformers.LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 3}),
        max_cache_len=MAX_CACHE,
    )
    refused("has 3 layers, but the model was compiled for a cache of 2", deeper)
    refused("is a DynamicCache, but the model was compiled for a StaticCache",
            transformers.DynamicCache(config=model.config))  # fmt: skip
    cache = new_cache(model)
    with torch.no_grad():
        compiled(input_ids=torch.zeros(1, 60, dtype=torch.long), past_key_values=cache,
                 use_cache=True, cache_position=torch.arange(60))  # fmt: skip
    keys = cache.layers[0].keys.clone()
    refused("holds 60 tokens of max_cache_len 64, and this call writes 5 more", cache,
            torch.zeros(1, 5, dtype=torch.long), cache_position=torch.arange(60, 65))  # fmt: skip
    refused("cache_position is \\[3\\], but past_key_values holds 60 tokens", cache,
            cache_position=torch.tensor([3]))  # fmt: skip
    assert int(cache.layers[0].cumulative_length) == 60 and torch.equal(cache.layers[0].keys, keys)
    # An eager step on the same cache is seen (its counter's version moved): 61 now.
    with torch.no_grad():
        model(input_ids=one, past_key_values=cache, use_cache=True)
    refused("holds 61 tokens", cache, torch.zeros(1, 4, dtype=torch.long),
            cache_position=torch.arange(61, 65))  # fmt: skip
    cache.reset()  # zeroes the counters in place: seen too
    with torch.no_grad():
        compiled(input_ids=one, past_key_values=cache, use_cache=True,
                 cache_position=torch.arange(1))  # fmt: skip
    assert int(cache.layers[1].cumulative_length) == 1


def test_unsupported_caches_are_refused_at_compile(tmp_path: Any) -> None:
    model = build("llama")
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(precompile.UnsupportedGraphError, match="StaticCache"):
        precompile.compile_model(
            model, (), {"input_ids": ids, "past_key_values": transformers.DynamicCache(
                config=model.config), "use_cache": True}, cache=str(tmp_path),
        )  # fmt: skip
    with pytest.raises(precompile.InvalidOptionError, match="Dynamo specializes sizes 0 and 1"):
        precompile.compile_model(
            model, (), {"input_ids": ids, "past_key_values": new_cache(model), "use_cache": True},
            dynamic={"input_ids": [0]}, cache=str(tmp_path),
        )  # fmt: skip
    with pytest.raises(precompile.InvalidOptionError, match="only its batch"):
        precompile.compile_model(
            model, (), {"input_ids": ids, "past_key_values": new_cache(model), "use_cache": True},
            dynamic={"past_key_values": [2]}, cache=str(tmp_path),
        )  # fmt: skip


WARM = (
    AUDIT
    + COUNTED
    + """
import sys, time, torch, precompile
sys.path.insert(0, "tests")
import decode_helpers as t
model = t.build("llama")
compiled = precompile.load_model(model, path=sys.argv[1])
torch.manual_seed(1)
prompt = torch.randint(0, t.VOCAB, (1, 7))
ours = t.greedy(compiled, model, prompt, True)
same = torch.equal(ours, t.greedy(model, model, prompt))
print("frames", len(frames), "compiles", len(compiles), "spawned", len(spawned), "same", same)
"""
)


def test_a_fresh_process_decodes_on_a_new_cache_without_tracing(
    llama: tuple[Any, Any], tmp_path: Any
) -> None:
    _, compiled = llama
    path = os.path.join(str(tmp_path), "llama-decode.pt2c")
    compiled.save(path)
    out = run_python(WARM.replace("sys.argv[1]", repr(path)))
    assert "frames 0 compiles 0 spawned 0 same True" in out, out


# -- generate() ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_is_served_by_compiled_models(arch: str, cache_dir: str) -> None:
    model = build(arch)
    torch.manual_seed(4)
    prompt = torch.randint(0, VOCAB, (1, 7))
    options = dict(max_new_tokens=STEPS, do_sample=False, cache_implementation="static",
                   pad_token_id=0)  # fmt: skip
    inner: list[int] = []
    # counts eager forwards only: a compiled model runs no Python of the forward (a hook's
    # side effect Dynamo traced would also be guarded by the list's length)
    model.model.register_forward_pre_hook(
        lambda module, args: None if torch.compiler.is_compiling() else inner.append(1)
    )
    with torch.no_grad():
        eager = model.generate(prompt, **options)
        eager_calls = len(inner)
        # transformers' loop, each forward on a compiled model (the compiled loop, the
        # default, is tests/models/test_generate_loop.py's)
        with precompile.serve_generate(model, hints=[8], cache=cache_dir, loop=False) as served:
            first = model.generate(prompt, **options)  # compiles each call structure once
            inner.clear()
            torch.manual_seed(5)
            other = torch.randint(0, VOCAB, (1, 7))
            second = model.generate(other, **options)
            served_inner = len(inner)
            # another output length, in the same block: generate sizes its static cache to
            # prompt + new tokens, so this is a cache of another length (another compile)
            longer = model.generate(other, **{**options, "max_new_tokens": STEPS + 6})
            # a shorter request after it: transformers keeps sizing its static cache to
            # the longest it made for this model (as eager generate does), so the longer
            # cache's compiled models serve it, with no compile
            compiled = len(served.compiled)
            shorter = model.generate(other, **options)
            kept = getattr(model, "_previous_max_cache_length", None)
            assert kept is None or len(served.compiled) == compiled
        assert "forward" not in vars(model)  # the hook is gone after the block
        expected_longer = model.generate(other, **{**options, "max_new_tokens": STEPS + 6})
        expected = model.generate(other, **options)  # on the longest cache, as served
        vars(model).pop("_previous_max_cache_length", None)
        expected_second = model.generate(other, **options)  # its own cache length
    assert torch.equal(longer, expected_longer) and torch.equal(shorter, expected)
    assert eager_calls == STEPS and served.calls == 3 * STEPS + STEPS + 6
    assert torch.equal(first, eager) and torch.equal(second, expected_second)
    assert served_inner == 0  # no eager forward ran inside the second generate
    assert 2 <= len(served.compiled) <= 6  # prefill and decode, per cache length


def test_a_prepared_server_compiles_nothing_in_front_of_a_request(cache_dir: str) -> None:
    """``served.prepare`` builds the structures requests of the declared shapes make;
    afterwards those requests compile nothing (counted), answer as eager, and an
    undeclared shape is refused with ``compile_others=False`` instead of compiled in
    front of its request. Preparing leaves the caller's generator alone. (The store is
    this module's: after the test above, prepare loads what it compiled.)"""
    from precompile import _variant_compile

    model = build("llama")
    options = dict(max_new_tokens=STEPS, do_sample=False, cache_implementation="static",
                   pad_token_id=0)  # fmt: skip
    torch.manual_seed(6)
    prompts = [torch.randint(1, VOCAB, (1, 7)), torch.randint(1, VOCAB, (1, 4))]
    longer = {**options, "max_new_tokens": STEPS + 6}
    with torch.no_grad():
        expected_longer = model.generate(prompts[0], **longer)
        vars(model).pop("_previous_max_cache_length", None)
        expected = [model.generate(p, **options) for p in prompts]
        vars(model).pop("_previous_max_cache_length", None)
        compiles: list[int] = []
        real = _variant_compile.compile_variant

        def counted(*args: Any, **kwargs: Any) -> Any:
            compiles.append(1)
            return real(*args, **kwargs)

        state = torch.random.get_rng_state()
        with (
            precompile.serve_generate(model, hints=[8], cache=cache_dir, loop=False) as served,
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr(_variant_compile, "compile_variant", counted)
            prepared = served.prepare([1], [7], compile_others=False, **options)
            assert torch.equal(torch.random.get_rng_state(), state)
            assert prepared.shapes == ((1, 7),) and prepared.structures >= 2
            compiles.clear()
            got = [model.generate(p, **options) for p in prompts]
            assert compiles == [] and served.stats["unprepared_compiles"] == 0
            with pytest.raises(precompile.ArtifactNotFoundError, match="not among the prepared"):
                model.generate(torch.randint(1, VOCAB, (3, 7)), **options)
            # a refused longer request moved transformers' kept cache length: put back, so
            # the prepared shapes still serve (a client trial: every later request missed)
            with pytest.raises(precompile.ArtifactNotFoundError, match="not among the prepared"):
                model.generate(prompts[0], **longer)
            assert torch.equal(model.generate(prompts[0], **options), got[0])
            assert compiles == [] and served.stats["calls"] == 3 * STEPS
            # a later prepare builds what it is asked for, compile_others=False before or not
            # (the store has these from the test above: loaded, not compiled)
            again = served.prepare([1], [7], **longer)
            assert again.structures >= 2
            assert torch.equal(model.generate(prompts[0], **longer), expected_longer)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_prepare_refuses_what_it_cannot_run() -> None:
    model = build("llama")
    with precompile.serve_generate(model, hints=[8], cache=False) as served:
        for bad in ([], [0], [2.0], 3, [True]):
            with pytest.raises(precompile.InvalidOptionError, match="batch_sizes"):
                served.prepare(bad, [7], max_new_tokens=4)  # type: ignore[arg-type]
        with pytest.raises(precompile.InvalidOptionError, match="makes the prompts itself"):
            served.prepare([1], [7], max_new_tokens=4, input_ids=torch.ones(1, 7))
        with pytest.raises(precompile.InvalidOptionError, match="compile_others"):
            served.prepare([1], [7], max_new_tokens=4, compile_others="no")  # type: ignore[arg-type]
        held = new_cache(model)
        with torch.no_grad():
            type(model).forward(model, input_ids=torch.ones(1, 3, dtype=torch.long),
                                past_key_values=held, use_cache=True)  # fmt: skip
        with pytest.raises(precompile.InvalidOptionError, match="empty KV cache"):
            served.prepare([1], [7], max_new_tokens=4, past_key_values=held)
    with pytest.raises(precompile.InvalidOptionError, match="inside the serve_generate block"):
        served.prepare([1], [7], max_new_tokens=4)


def test_serve_generate_names_the_static_cache_a_dynamic_one_needs() -> None:
    """``generate`` without a static cache passes a growing cache: refused before any
    compile, saying what to pass; the model is itself again after the block."""
    model = build("llama")
    prompt = torch.randint(0, VOCAB, (1, 5))
    with (
        torch.no_grad(),
        pytest.raises(precompile.UnsupportedGraphError, match="cache_implementation='static'"),
        precompile.serve_generate(model, hints=[8]) as served,
    ):
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not served.compiled and "forward" not in vars(model)


def test_serve_generate_checks_its_options_before_any_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bad options are refused when the block is made, by name, with the library's own
    error (``hints="abc"`` once surfaced at the first generate as Dynamo's
    ``BackendCompilerFailed``); a call structure that cannot be compiled is refused
    naming generate's call and what to try, and refused again without a new trace."""
    model = build("llama")
    for bad, message in [
        (dict(model="not a model"), "takes a torch.nn.Module, got str"),
        (dict(dynamic_batch="yes"), "dynamic_batch must be True or False"),
        (dict(foo=1), r"unknown options \['foo'\]"),
        (dict(hints="abc"), "hints must be"),
        (dict(cudagraphs="yes"), "cudagraphs must be"),
    ]:
        with pytest.raises(precompile.InvalidOptionError, match=message):
            precompile.serve_generate(**{"model": model, **bad})  # type: ignore[arg-type]
    with pytest.raises(precompile.InvalidOptionError, match="hints must be"):
        precompile.compile_model(model, (), {"input_ids": torch.zeros(1, 3, dtype=torch.long)},
                                 hints="abc", cache=False)  # fmt: skip
    from precompile import _generate

    tried: list[object] = []

    def refuses(*args: Any, **kwargs: Any) -> None:
        tried.append(kwargs)
        # the hint follows the error's field, not its words
        raise precompile.UnsupportedGraphError(
            "the batch was fixed at 2 by the trace", specialized=("input_ids", 0)
        )

    monkeypatch.setattr(_generate, "compile_model", refuses)
    prompt = torch.randint(0, VOCAB, (2, 4))
    with (
        torch.no_grad(),
        precompile.serve_generate(model, dynamic_batch=True, hints=[8], loop=False),
    ):
        for _ in range(2):
            with pytest.raises(precompile.UnsupportedGraphError) as refused:
                model.generate(prompt, max_new_tokens=2, cache_implementation="static",
                               do_sample=False, pad_token_id=0)  # fmt: skip
            text = str(refused.value)
            assert "generate's prefill" in text and "dynamic_batch=False" in text, text
            assert "fixed at 2" in text
    assert len(tried) == 1  # the second generate was refused without a new trace
    assert "forward" not in vars(model)


def test_serve_generate_call_signatures_tell_apart_what_its_keys_do() -> None:
    """The router's per-step shortcut: a call signature seen before names the compiled
    model its full key chose. Equal signatures must mean equal keys (else a call would
    reach a model compiled for another cache length, plain value or shape); anything the
    signature cannot describe has none and takes the full key."""
    from precompile._generate import _call_signature, _static_sizes, _structure

    model = build("llama")

    def key(kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (*_structure((), kwargs), _static_sizes(kwargs, False))

    base = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": new_cache(model),
            "use_cache": True, "logits_to_keep": 1}  # fmt: skip
    variants = [
        {**base, "input_ids": torch.zeros(2, 1, dtype=torch.long)},  # another batch
        {**base, "input_ids": torch.zeros(1, 5, dtype=torch.long)},  # a prompt
        {**base, "past_key_values": new_cache(model, length=MAX_CACHE * 2)},  # longer cache
        {**base, "use_cache": 1},  # a plain value of another type
        {**base, "logits_to_keep": 0},
        {**base, "attention_mask": torch.ones(1, 1, 1, MAX_CACHE)},  # one argument more
        # ids of another dtype: a model compiled for int32 ids refused int64 ones
        # (InputMismatchError) where eager answers both (a docs-only client trial)
        {**base, "input_ids": torch.zeros(1, 1, dtype=torch.int32)},
    ]
    assert _call_signature(base) == _call_signature({**base, "past_key_values": new_cache(model)})
    for other in variants:
        assert key(other) != key(base)
        assert _call_signature(other) != _call_signature(base), other
    assert _call_signature({**base, "labels": [torch.zeros(1)]}) is None
    # generate's masks by layer type (Qwen2): a dict whose fixed sizes are part of the key
    masks = [{**base, "attention_mask": {"full_attention": torch.ones(1, 1, 1, n)}}
             for n in (MAX_CACHE, MAX_CACHE * 2)]  # fmt: skip
    assert key(masks[0]) != key(masks[1])
    assert _call_signature(masks[0]) != _call_signature(masks[1]) is not None


# -- CUDA graphs ---------------------------------------------------------------------------
def test_graphs_that_write_a_static_cache_are_capturable(llama: tuple[Any, Any]) -> None:
    """The cache tensors the graph writes are static-address inputs: captured in place
    (on CUDA). One Dynamo did not mark static (a cache first filled inside another
    torch.compile trace) is captured in place too; an input the graph resizes is not."""
    import dataclasses

    from precompile.runtime._cudagraphs import why_not_capturable
    from precompile.runtime.compiler_interface import TensorInput

    manifest = llama[1].artifact.manifest
    written = [i for i, s in enumerate(manifest.inputs)
               if isinstance(s, TensorInput) and s.mutation == "data"]  # fmt: skip
    assert len(written) == 6  # keys, values and counter of 2 layers
    assert all(manifest.inputs[i].static_address for i in written)
    on_cuda = dataclasses.replace(
        manifest,
        environment=dataclasses.replace(manifest.environment, device_type="cuda"),
        inputs=tuple(
            dataclasses.replace(s, device="cuda:0") if isinstance(s, TensorInput) else s
            for s in manifest.inputs
        ),
    )
    assert why_not_capturable(on_cuda) is None
    inputs = list(on_cuda.inputs)
    inputs[written[0]] = dataclasses.replace(inputs[written[0]], static_address=False)
    assert why_not_capturable(dataclasses.replace(on_cuda, inputs=tuple(inputs))) is None
    inputs[written[0]] = dataclasses.replace(inputs[written[0]], mutation="metadata")
    reason = why_not_capturable(dataclasses.replace(on_cuda, inputs=tuple(inputs)))
    assert reason is not None and "resizes input" in reason


@pytest.fixture(scope="module")
def cuda_llama(cache_dir: str) -> tuple[Any, Any, Any]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    call = {"input_ids": torch.randint(0, VOCAB, (2, 7), device="cuda"),
            "past_key_values": new_cache(model), "use_cache": True}  # fmt: skip
    options: dict[str, Any] = dict(
        dynamic={"input_ids": [0, 1]},
        hints={("input_ids", 0): [1, 8], ("input_ids", 1): [1, 8]},
        sizes=[],
        cache=cache_dir,
    )
    with torch.no_grad():
        plain = precompile.compile_model(model, (), call, **options)
        graphs = precompile.compile_model(model, (), call, cudagraphs=True, **options)
    return model, plain, graphs


@pytest.mark.gpu
def test_cudagraph_decode_matches_the_same_model_without_graphs(
    cuda_llama: tuple[Any, Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    model, plain, graphs = cuda_llama
    caplog.set_level(logging.WARNING, logger="precompile")
    torch.manual_seed(6)
    for batch in (1, 3, 8):
        prompt = torch.randint(0, VOCAB, (batch, 7), device="cuda")
        assert torch.equal(greedy(graphs, model, prompt), greedy(plain, model, prompt))
    # decode steps (one token) are served by the model's traces at length 1 (pieces: at
    # batch 1, and with the batch dynamic)
    decode_graphs = [s for p in graphs.pieces.values() for s in p.artifact.captured_sizes]
    assert len(decode_graphs) >= 3, decode_graphs  # one per batch size
    # A graph is bound to the cache it was captured on: another cache object drops it
    # (the call runs plainly, the next one captures again) and the first cache is never
    # written through a stale graph.
    prompt = torch.randint(0, VOCAB, (1, 7), device="cuda")
    first, second = new_cache(model), new_cache(model)
    with torch.no_grad():
        for cache in (first, second):
            tokens = prompt
            for _ in range(4):
                tokens = graphs(input_ids=tokens, past_key_values=cache,
                                use_cache=True).logits[:, -1:].argmax(-1)  # fmt: skip
        kept = first.layers[0].keys.clone()
        with caplog.at_level(logging.INFO, logger="precompile"):
            for _ in range(4):
                tokens = graphs(input_ids=tokens, past_key_values=second,
                                use_cache=True).logits[:, -1:].argmax(-1)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(first.layers[0].keys, kept)
    assert int(first.layers[0].cumulative_length) == 7 + 3
    assert int(second.layers[0].cumulative_length) == 7 + 3 + 4
    expected = greedy(plain, model, prompt)
    assert torch.equal(greedy(graphs, model, prompt), expected)
    # a dropped graph is captured again (the allocator once refused a new capture into
    # the pool of graphs that were all dropped, and the size then ran plainly for good)
    assert "capture failed" not in caplog.text, caplog.text


@pytest.mark.gpu
def test_decode_variants_on_cudnn_attention_keep_cublas_gemms(
    cuda_llama: tuple[Any, Any, Any],
) -> None:
    """The GEMM policy (``precompile._gemm_policy``): a hint variant that serves many
    batch sizes of a decode step (attention lengths fixed, so cuDNN attention) keeps
    inductor's cuBLAS GEMMs; a prefill hint variant (lengths free) takes Triton
    templates."""
    _, plain, _ = cuda_llama
    blas: dict[str, set[bool]] = {"decode": set(), "prefill": set()}
    for compiled in (plain, *plain.pieces.values()):
        manifest = compiled.artifact.manifest
        leaf, dim = compiled.plan.tokens  # input_ids' sequence dim
        index = compiled.plan.bindings.index(("leaf", leaf))
        tokens = manifest.inputs[index].shape[dim]  # 1, or a symbol's name
        for variant in manifest.variants:
            if variant.kind != "hint" or variant.lean is None:
                continue
            if all(value <= 1 for value in variant.point.values()):
                continue  # specialized to one size: cuBLAS whatever its attention
            decode = tokens == 1 or variant.point.get(tokens) == 1
            kind = "decode" if decode else "prefill"
            blas[kind].add(bool({"mm", "addmm", "bmm"} & set(variant.lean.externs)))
    assert blas == {"decode": {True}, "prefill": {False}}, blas


@pytest.mark.gpu
def test_generate_with_cudagraphs_matches_without(
    cuda_llama: tuple[Any, Any, Any], cache_dir: str
) -> None:
    model = cuda_llama[0]
    prompt = torch.randint(0, VOCAB, (2, 7), device="cuda")
    options = dict(max_new_tokens=STEPS, do_sample=False, cache_implementation="static",
                   pad_token_id=0)  # fmt: skip
    outputs = []
    with torch.no_grad():
        for graphs in (False, True):
            with precompile.serve_generate(model, hints=[8], cache=cache_dir, loop=False,
                                           cudagraphs=graphs) as served:  # fmt: skip
                outputs.append(model.generate(prompt, **options))
            assert served.calls == STEPS
    assert torch.equal(outputs[0], outputs[1])


def _synchronizations(run: Callable[[], object]) -> int:
    """How many times ``run`` waited for the GPU (torch's sync debug mode, as warnings)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _common import gpu_waits

    return len(gpu_waits(run))


@pytest.mark.gpu
def test_served_decode_steps_never_wait_for_the_gpu(cuda_llama: tuple[Any, Any, Any]) -> None:
    """32 decode steps, plain and replayed from CUDA graphs, run under
    ``set_sync_debug_mode("error")``: no call (the cache's position checks included) waits
    for the GPU. A whole greedy ``generate`` waits only at its start, as many times for 4
    tokens as for 32: once to read how much the new cache holds (the check that the
    prompt and the new tokens fit) and once to capture the decode step's graph again for
    the new cache object (a capture synchronizes)."""
    model, plain, graphs = cuda_llama
    prompt = torch.randint(0, VOCAB, (2, 7), device="cuda")
    with torch.no_grad():
        for compiled in (plain, graphs):
            cache = new_cache(model)
            tokens = compiled(input_ids=prompt, past_key_values=cache,
                              use_cache=True).logits[:, -1:].argmax(-1)  # fmt: skip
            for _ in range(3):  # a graph that writes its inputs is captured at a 2nd call
                tokens = compiled(input_ids=tokens, past_key_values=cache,
                                  use_cache=True).logits[:, -1:].argmax(-1)  # fmt: skip
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(STEPS):
                    tokens = compiled(input_ids=tokens, past_key_values=cache,
                                      use_cache=True).logits[:, -1:].argmax(-1)  # fmt: skip
            finally:
                torch.cuda.set_sync_debug_mode("default")
        graphs.generate(prompt, new_cache(model), max_new_tokens=4)  # captures

        # A new cache is initialized outside: transformers' own initialization copies its
        # length counter to the GPU, which waits (once per cache, not per call). Each is
        # kept alive, so that no later cache takes its addresses (and its step graph).
        caches: list[Any] = []

        def generate(steps: int) -> Callable[[], object]:
            caches.append(new_cache(model, 2, dtype=torch.bfloat16, device="cuda"))
            fresh = caches[-1]
            return lambda: graphs.generate(prompt, fresh, max_new_tokens=steps)

        waits = [_synchronizations(generate(steps)) for steps in (4, STEPS)]
        assert waits[0] == waits[1] <= 2, waits
        caches[-1].reset()  # the same cache again: its step graph replays, none captured
        again = _synchronizations(lambda: graphs.generate(prompt, caches[-1], max_new_tokens=STEPS))
        assert again <= 1, again


@pytest.mark.gpu
def test_compiled_generate_with_cudagraphs_matches_without(
    cuda_llama: tuple[Any, Any, Any],
) -> None:
    """Greedy and seeded sampled tokens of ``CompiledModel.generate`` are identical with
    and without CUDA graphs (bf16 on the GPU)."""
    model, plain, graphs = cuda_llama
    prompt = torch.randint(0, VOCAB, (3, 7), device="cuda")
    for options in ({}, {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}):
        outputs, states = [], []
        for compiled in (plain, graphs, graphs):  # graphs twice: captured, then replayed
            generator = torch.Generator(device="cuda").manual_seed(11)
            outputs.append(compiled.generate(prompt, new_cache(model), max_new_tokens=STEPS,
                                             generator=generator, **options))  # fmt: skip
            states.append(generator.get_state())
        assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
        # the caller's generator is left where the run without graphs leaves it
        assert torch.equal(states[0], states[1]) and torch.equal(states[0], states[2])
    # the sampled steps ran in a graph drawing from its own generator (a generator made
    # for "cuda" has no device index; it was once taken for another device's)
    assert any(key[2][4] for key in graphs._decode_graphs._graphs)  # Sampling.key: own generator
    outputs = []  # sampling from torch's default generator, inside the graph too
    for compiled in (plain, graphs, graphs):
        torch.manual_seed(5)
        outputs.append(compiled.generate(prompt, new_cache(model), max_new_tokens=STEPS,
                                         do_sample=True, top_k=20))  # fmt: skip
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.gpu
def test_generate_replays_its_step_graph_only_where_it_is_sound(
    cuda_llama: tuple[Any, Any, Any],
) -> None:
    """With CUDA graphs, ``generate`` captures its whole decode step (the forward, the
    choice of the token and the advance of its buffers) once per batch, cache and
    settings, and replays it per token. A later generate on the same cache (``reset()``)
    replays the graph the first one captured; rows stopping at EOS give the tokens of the
    model without graphs; a parameter replaced in between (the graph read the old one's
    memory) drops the graph, and the tokens follow the new weights; a model switched to
    ``train()`` is refused, though its graph exists."""
    model, plain, graphs = cuda_llama
    torch.manual_seed(21)
    prompt = torch.randint(0, VOCAB, (3, 7), device="cuda")
    cache = new_cache(model)
    want = plain.generate(prompt, new_cache(model), max_new_tokens=STEPS)
    assert torch.equal(graphs.generate(prompt, cache, max_new_tokens=STEPS), want)
    steps = graphs._decode_graphs
    assert steps is not None
    # the module's tests share the model's graphs: this generate's is the latest used
    assert steps._graphs and not steps._refused, steps._refused
    captured, latest = dict(steps._graphs), next(reversed(steps._graphs.values()))
    cache.reset()
    assert torch.equal(graphs.generate(prompt, cache, max_new_tokens=STEPS), want)
    assert dict(steps._graphs) == captured  # replayed: nothing captured again
    assert next(reversed(steps._graphs.values())) is latest

    eos = int(want[1, 7 + 3])  # row 1 stops at its 4th token
    options: dict[str, Any] = dict(max_new_tokens=STEPS, eos_token_id=eos, pad_token_id=0)
    for _ in range(2):  # captured, then replayed
        cache.reset()
        got = graphs.generate(prompt, cache, **options)
        assert torch.equal(got, plain.generate(prompt, new_cache(model), **options))
        assert int(got[1, 7 + 3]) == eos and bool((got[1, 7 + 4 :] == 0).all())

    head = model.lm_head.weight
    try:
        with torch.no_grad():
            model.lm_head.weight = torch.nn.Parameter(head.flip(0))  # other tokens
        cache.reset()
        got = graphs.generate(prompt, cache, max_new_tokens=8)
        assert torch.equal(got, plain.generate(prompt, new_cache(model), max_new_tokens=8))
        assert not torch.equal(got, want[:, : 7 + 8])
    finally:
        model.lm_head.weight = head
    cache.reset()
    assert torch.equal(graphs.generate(prompt, cache, max_new_tokens=STEPS), want)
    model.train()
    try:
        cache.reset()
        with pytest.raises(precompile.InputMismatchError, match="train"):
            graphs.generate(prompt, cache, max_new_tokens=4)
    finally:
        model.eval()


@pytest.mark.gpu
@pytest.mark.parametrize("sample", [False, True])
def test_prepare_generate_captures_the_step_graph_before_a_request(
    cuda_llama: tuple[Any, Any, Any], sample: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``prepare_generate`` captures the step graph a later ``generate`` on that cache
    replays (in another thread here: a graph replays in any thread), so the request
    captures nothing, and the prefill's graph at a prompt length it is given, so the
    request's prefill is a replay; its tokens are those of the model without graphs, the
    cache is left empty, and neither the caller's generator nor torch's default one
    moves."""
    from precompile.runtime._cudagraphs import _Graph

    model, plain, graphs = cuda_llama
    options: dict[str, Any] = {"do_sample": True, "top_k": 20} if sample else {}
    torch.manual_seed(31)
    prompt = torch.randint(0, VOCAB, (5, 7), device="cuda")  # a batch no other test runs
    cache = new_cache(model)
    generator = torch.Generator(device="cuda").manual_seed(3)
    state, default = generator.get_state(), torch.cuda.get_rng_state()
    prepared: list[bool] = []

    def prepare() -> None:
        prepared.append(graphs.prepare_generate(cache, 5, generator=generator,
                                                prompt_lengths=[7], **options))  # fmt: skip

    side = threading.Thread(target=prepare)
    side.start()
    side.join()
    assert prepared == [True], caplog.text
    assert torch.equal(generator.get_state(), state)
    assert torch.equal(torch.cuda.get_rng_state(), default)
    assert graphs._caches.held(cache) == 0
    assert not any(bool(layer.keys.any()) for layer in cache.layers)

    steps = graphs._decode_graphs
    captures: list[object] = []
    replays: list[object] = []
    real, replay = steps.capture, _Graph.replay

    def counted(*args: Any, **kwargs: Any) -> Any:
        captures.append(args)
        return real(*args, **kwargs)

    def replayed(self: Any, *args: Any, **kwargs: Any) -> Any:
        replays.append(args)
        return replay(self, *args, **kwargs)

    outputs = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(steps, "capture", counted)
        patch.setattr(_Graph, "replay", replayed)
        for compiled, target in ((plain, new_cache(model)), (graphs, cache)):
            drawn = torch.Generator(device="cuda").manual_seed(9)
            outputs.append(compiled.generate(prompt, target, max_new_tokens=STEPS,
                                             generator=drawn, **options))  # fmt: skip
    assert captures == []  # the request replayed the prepared step graph
    assert len(replays) == 1  # and the prepared prefill graph (the steps: the step graph)
    assert torch.equal(outputs[0], outputs[1])


def test_step_graph_keys_tell_apart_what_a_step_graph_bakes_in() -> None:
    """A kept step graph is found by what it bakes in: greedy steps read no sampling
    setting (a prepared greedy graph serves a generate passing a temperature), while the
    batch, sampling settings, a generator of its own, EOS ids, fill and the cache's
    addresses each pick another graph."""
    import types

    from precompile.runtime._decode_loop import step_graph_key
    from precompile.runtime._sampling import Sampling

    def cache() -> Any:
        counter = torch.zeros((), dtype=torch.long)
        layer = types.SimpleNamespace(keys=torch.zeros(2), values=torch.zeros(2),
                                      cumulative_length=counter)  # fmt: skip
        return types.SimpleNamespace(layers=[layer])

    first, second = cache(), cache()
    names = ["input_ids", "past_key_values"]

    def key(batch: int = 2, kept: Any = first, **options: Any) -> Any:
        return step_graph_key(batch, names, kept, Sampling.of(**options))

    assert key(temperature=0.7, top_k=5, top_p=0.9) == key()
    assert key(generator=torch.Generator()) == key()  # greedy draws from none
    sampled = key(do_sample=True)
    assert sampled != key() and key(do_sample=True, temperature=0.7) != sampled
    assert key(do_sample=True, generator=torch.Generator()) != sampled
    assert key(eos_token_id=2, pad_token_id=0) == key(eos_token_id=[2], pad_token_id=0)
    assert key(eos_token_id=2, pad_token_id=0) != key(eos_token_id=2, pad_token_id=1)
    assert key(batch=3) != key() and key(kept=second) != key()


def test_prepare_generate_neither_loses_tokens_nor_leaves_made_up_ones(
    llama: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache that holds tokens is refused before anything is written (resetting it
    would lose them); a made-up generate that fails after writing leaves the cache
    empty. (CUDA graphs stood in for: this runs on the CPU.)"""
    model, compiled = llama
    monkeypatch.setattr(compiled, "_graphed_steps", lambda ids: object())
    cache = new_cache(model)
    with torch.no_grad():
        compiled(input_ids=torch.randint(0, VOCAB, (2, 5)), past_key_values=cache,
                 use_cache=True, cache_position=torch.arange(5))  # fmt: skip
    kept = cache.layers[0].keys.clone()
    with pytest.raises(precompile.InvalidOptionError, match="already holds 5 tokens"):
        compiled.prepare_generate(cache, 2)
    assert torch.equal(cache.layers[0].keys, kept) and compiled._caches.held(cache) == 5

    def fails_after_writing(ids: torch.Tensor, written: Any, *options: Any) -> None:
        compiled(input_ids=ids, past_key_values=written, use_cache=True,
                 cache_position=torch.arange(1))  # fmt: skip
        raise RuntimeError("a capture failed")

    fresh = new_cache(model)
    monkeypatch.setattr(compiled, "_generate", fails_after_writing)
    with torch.no_grad(), pytest.raises(RuntimeError, match="capture failed"):
        compiled.prepare_generate(fresh, 2)
    assert compiled._caches.held(fresh) == 0

    # prompt lengths: the step, then each length twice (a graph that writes the cache is
    # captured at its 2nd call), every made-up generate on an empty cache, none left
    runs: list[tuple[list[int], int, int]] = []

    def writes(ids: torch.Tensor, written: Any, max_new_tokens: int, *options: Any) -> None:
        runs.append((list(ids.shape), max_new_tokens, compiled._caches.held(written)))
        compiled(input_ids=ids, past_key_values=written, use_cache=True,
                 cache_position=torch.arange(ids.shape[1]))  # fmt: skip

    monkeypatch.setattr(compiled, "_generate", writes)
    monkeypatch.setattr(compiled, "_graphed_steps", lambda ids: SimpleNamespace(graphs=[]))
    with torch.no_grad():
        assert not compiled.prepare_generate(fresh, 2, prompt_lengths=[4, 6, 4])  # none kept
    assert runs == [([2, 1], 3, 0), ([2, 4], 1, 0), ([2, 4], 1, 0), ([2, 6], 1, 0),
                    ([2, 6], 1, 0)]  # fmt: skip
    assert compiled._caches.held(fresh) == 0


def test_prepare_generate_refuses_a_model_without_cuda_graphs(llama: tuple[Any, Any]) -> None:
    model, compiled = llama
    cache = new_cache(model)
    with pytest.raises(precompile.InvalidOptionError, match="takes input_ids on cpu"):
        compiled.prepare_generate(cache, 2)
    with pytest.raises(precompile.InvalidOptionError, match="batch_size"):
        compiled.prepare_generate(cache, 0)
    with pytest.raises(precompile.InvalidOptionError, match="StaticCache"):
        compiled.prepare_generate(object(), 2)
    for lengths, message in [
        ([MAX_CACHE + 1], rf"length {MAX_CACHE + 1} does not fit the cache \(max_cache_len 64\)"),
        ([0], "ints >= 1"),
        ([True], "ints >= 1"),
        ("16", "a sequence of ints"),
        (16, "a sequence of ints"),
    ]:
        with pytest.raises(precompile.InvalidOptionError, match=message):
            compiled.prepare_generate(cache, 2, prompt_lengths=lengths)  # type: ignore[arg-type]


def _reference(model: torch.nn.Module, prompt: torch.Tensor, **options: Any) -> torch.Tensor:
    """transformers' own ``generate`` (a dynamic cache, eager)."""
    with torch.no_grad():
        out: torch.Tensor = model.generate(prompt, pad_token_id=0, **options)
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_gives_transformers_tokens(llama: tuple[Any, Any], batch: int) -> None:
    """``CompiledModel.generate``, the public decode loop: greedy tokens, rows stopping at
    EOS, and sampled tokens (temperature, top-k, top-p, torch's default generator seeded
    alike) identical to transformers' ``generate`` on the same model."""
    model, compiled = llama
    torch.manual_seed(10 + batch)
    prompt = torch.randint(0, VOCAB, (batch, 6))
    want = _reference(model, prompt, max_new_tokens=20, do_sample=False)
    got = compiled.generate(prompt, new_cache(model), max_new_tokens=20)
    assert torch.equal(got, want)
    eos = int(want[0, 6 + 3])  # a token row 0 emits early: it stops there, others go on
    want = _reference(model, prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    got = compiled.generate(prompt, new_cache(model), max_new_tokens=20, eos_token_id=eos,
                            pad_token_id=0)  # fmt: skip
    assert torch.equal(got, want) and got.shape[1] <= 6 + 20
    sampling = dict(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(7)
    want = _reference(model, prompt, do_sample=True, **sampling)  # type: ignore[arg-type]
    torch.manual_seed(7)
    got = compiled.generate(prompt, new_cache(model), do_sample=True, **sampling)  # type: ignore[arg-type]
    assert torch.equal(got, want)


def test_generate_samples_from_its_generator_alone(llama: tuple[Any, Any]) -> None:
    """One seed, one sequence: a ``torch.Generator`` given is all the loop draws from (the
    default generator is not advanced)."""
    model, compiled = llama
    prompt = torch.randint(0, VOCAB, (2, 5))
    runs = []
    for _ in range(2):
        before = torch.random.get_rng_state()
        generator = torch.Generator().manual_seed(123)
        runs.append(compiled.generate(prompt, new_cache(model), max_new_tokens=10,
                                      do_sample=True, generator=generator))  # fmt: skip
        assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(runs[0], runs[1])


def test_generate_refuses_bad_requests_by_name(llama: tuple[Any, Any]) -> None:
    model, compiled = llama
    prompt = torch.randint(0, VOCAB, (1, 5))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"max_new_tokens": 4, "do_sample": True, "temperature": 0.0}, "temperature must be"),
        ({"max_new_tokens": 4, "do_sample": True, "top_p": 1.5}, "top_p must be"),
        ({"max_new_tokens": 4, "do_sample": True, "top_k": 0}, "top_k must be"),
        ({"max_new_tokens": 4, "eos_token_id": 3}, "pad_token_id .* is needed"),
        ({"max_new_tokens": 4, "eos_token_id": -1, "pad_token_id": 0}, "eos_token_id must be"),
        ({"max_new_tokens": 4, "eos_token_id": 2.0, "pad_token_id": 0}, "eos_token_id must be"),
        (
            {"max_new_tokens": 4, "eos_token_id": torch.tensor([1.0]), "pad_token_id": 0},
            "eos_token_id must be",
        ),
        ({"max_new_tokens": MAX_CACHE}, f"the cache holds {MAX_CACHE} tokens"),
        ({"max_new_tokens": 4, "do_sample": True, "generator": "gen"}, "generator must be"),
    ]
    for options, message in bad:
        cache = new_cache(model)
        with pytest.raises(precompile.InvalidOptionError, match=message):
            compiled.generate(prompt, cache, **options)
        assert int(cache.layers[0].cumulative_length) == 0  # refused before any step
    # EOS ids as an integer tensor, as transformers takes them
    listed = compiled.generate(prompt, new_cache(model), max_new_tokens=6, eos_token_id=[3, 5],
                               pad_token_id=0)  # fmt: skip
    for ids in (torch.tensor([3, 5]), (3, 5)):
        got = compiled.generate(prompt, new_cache(model), max_new_tokens=6, eos_token_id=ids,
                                pad_token_id=0)  # fmt: skip
        assert torch.equal(got, listed)
    # One cache serves one generate at a time: a second one on it (another thread's) is
    # refused before it touches the cache.
    from precompile.runtime._decode_loop import _writing

    shared = new_cache(model)
    with _writing(shared), pytest.raises(precompile.InvalidOptionError, match="another generate"):
        compiled.generate(prompt, shared, max_new_tokens=4)
    assert int(shared.layers[0].cumulative_length) == 0
    compiled.generate(prompt, shared, max_new_tokens=4)  # the claim is released
    with pytest.raises(precompile.InvalidOptionError, match="input_ids must be"):
        compiled.generate(prompt.float(), new_cache(model), max_new_tokens=4)
    with pytest.raises(precompile.InvalidOptionError, match="past_key_values must be"):
        compiled.generate(prompt, {"not": "a cache"}, max_new_tokens=4)
    # A cache that holds tokens is refused before any step, however it was written (the
    # loop starts from an empty cache), and left as it was; reset() serves it again.
    fresh = compiled.generate(prompt, new_cache(model), max_new_tokens=6)
    by_generate, by_eager, by_call = new_cache(model), new_cache(model), new_cache(model)
    compiled.generate(prompt, by_generate, max_new_tokens=MAX_CACHE - 10)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=by_eager, use_cache=True)
        compiled(input_ids=prompt, past_key_values=by_call, use_cache=True,
                 cache_position=torch.arange(5))  # fmt: skip
    for used, holds in ((by_generate, 5 + MAX_CACHE - 11), (by_eager, 5), (by_call, 5)):
        with pytest.raises(precompile.InvalidOptionError, match=f"already holds {holds} tokens"):
            compiled.generate(prompt, used, max_new_tokens=6)
        assert int(used.layers[0].cumulative_length) == holds
        used.reset()
        assert torch.equal(compiled.generate(prompt, used, max_new_tokens=6), fresh)


def test_generate_serves_left_padded_batches(cache_dir: str) -> None:
    """A batch of prompts of different lengths, left-padded with an attention mask: the
    prefill's 4-d mask follows the prompt's length (its query dim is dynamic with it), so
    the tokens are eager's, with and without the batch dynamic."""
    model = build("llama")
    torch.manual_seed(6)
    prompt = torch.randint(1, VOCAB, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    prompt[0, :3], mask[0, :3] = 0, 0
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False,
                   cache_implementation="static", pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        eager = model.generate(prompt, **options)
        for dynamic_batch in (False, True):
            with precompile.serve_generate(model, hints=[8], cache=cache_dir,
                                           dynamic_batch=dynamic_batch) as served:  # fmt: skip
                assert torch.equal(model.generate(prompt, **options), eager)
            assert served.calls == 8


def test_generate_serves_a_left_padded_qwen2_batch(cache_dir: str) -> None:
    """transformers' ``generate`` hands Qwen2 (a config with ``layer_types``) its prefill
    mask as a dict by layer type (``{"full_attention": [batch, 1, query, key]}``), not a
    tensor: its query dim was left fixed, and the trace specialized input_ids' length to
    it ("dynamic dim 1 of argument 'input_ids' was specialized to 9"). Each tensor of the
    dict now follows the prompt's length: a left-padded batch of 3 gets eager's tokens."""
    from precompile._generate import _dynamic

    model = build("qwen2")
    torch.manual_seed(12)
    prompt = torch.randint(1, VOCAB, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    prompt[0, :4], mask[0, :4] = 0, 0  # a prompt of 5
    prompt[2, :1], mask[2, :1] = 0, 0  # of 8
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
                   cache_implementation="static", pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        eager = model.generate(prompt, **options)
        with precompile.serve_generate(model, hints=[8], cache=cache_dir) as served:
            assert torch.equal(model.generate(prompt, **options), eager)
    assert served.calls == 6 and len(served.compiled) == 2  # prefill, decode step
    # with the batch dynamic too, each mask of the dict follows the batch (a cheap check
    # of the dims asked for; the same call is served, tokens equal, in about 60 s)
    ids = torch.zeros(3, 9, dtype=torch.long)
    masks = {"full_attention": torch.ones(3, 1, 9, MAX_CACHE, dtype=torch.bool)}
    assert _dynamic({"input_ids": ids, "attention_mask": masks}, True)["attention_mask"] == [0, 2]


def test_generate_serves_left_padded_prompts(cache_dir: str, llama: tuple[Any, Any]) -> None:
    """Prompts of different lengths, left-padded with an attention mask: a model compiled
    with a ``[batch, max_cache_len]`` mask and position ids gives transformers'
    ``generate`` tokens (greedy, and rows stopping at EOS); the prompt's mask is left as it
    was; a bad mask, or a mask for a model compiled without one, is refused by name."""
    model = build("llama")
    call = {"input_ids": torch.randint(1, VOCAB, (2, 7)), "past_key_values": new_cache(model),
            "attention_mask": torch.ones(2, MAX_CACHE, dtype=torch.long),
            "position_ids": torch.arange(7).repeat(2, 1), "use_cache": True}  # fmt: skip
    # batches of 2 and more (the prompts here are 3): no trace at batch 1, two not four
    batches = (2, None)
    dynamic = {"input_ids": {0: batches, 1: None}, "attention_mask": {0: batches},
               "position_ids": {0: batches, 1: None}}  # fmt: skip
    with (
        torch.no_grad(),
        pytest.raises(
            precompile.UnsupportedGraphError, match=r"attention_mask.* dim 0 = 2.*same hints"
        ),
    ):
        # the mask's batch unhinted: a variant point of 8 rows of ids beside 2 of mask,
        # which the warm-up would run (its kernels' index check ends the process)
        precompile.compile_model(model, (), call, dynamic=dynamic, sizes=[], cache=cache_dir,
                                 hints={("input_ids", 0): [8], ("input_ids", 1): [8]})  # fmt: skip
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (), call, dynamic=dynamic,
            # the mask's batch is a symbol of its own: hinted with input_ids', so that no
            # variant's point pairs a batch of 8 ids with a mask of 2 rows (see Limits)
            hints={("input_ids", 0): [8], ("input_ids", 1): [8], ("attention_mask", 0): [8]},
            sizes=[], cache=cache_dir,
        )  # fmt: skip
    torch.manual_seed(12)
    prompt = torch.randint(1, VOCAB, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    prompt[0, :4], mask[0, :4] = 0, 0  # a prompt of 5
    prompt[2, :1], mask[2, :1] = 0, 0  # of 8
    before = mask.clone()
    want = _reference(model, prompt, attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = compiled.generate(prompt, new_cache(model), attention_mask=mask, max_new_tokens=16)
    assert torch.equal(got, want) and torch.equal(mask, before)
    eos = int(want[1, 9 + 2])
    want = _reference(model, prompt, attention_mask=mask, max_new_tokens=16, do_sample=False,
                      eos_token_id=eos)  # fmt: skip
    got = compiled.generate(prompt, new_cache(model), attention_mask=mask, max_new_tokens=16,
                            eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert torch.equal(got, want)
    right = mask.flip(-1)  # padded on the right
    with pytest.raises(precompile.InvalidOptionError, match="pads prompts on the left"):
        compiled.generate(prompt, new_cache(model), attention_mask=right, max_new_tokens=2)
    with pytest.raises(precompile.InvalidOptionError, match=r"attention_mask must be .*\[3, 9\]"):
        compiled.generate(prompt, new_cache(model), attention_mask=mask[:, 1:], max_new_tokens=2)
    _, without_mask = llama  # compiled with no attention_mask
    with pytest.raises(precompile.InvalidOptionError, match="compiled without one"):
        without_mask.generate(prompt, new_cache(model), attention_mask=mask, max_new_tokens=2)


def test_a_padded_mask_needs_position_ids_in_the_compiled_call() -> None:
    """Without position_ids the model would count positions from the cache, where
    transformers' generate counts them from the mask: padded rows would answer otherwise,
    so a padded mask is refused before any step (an unpadded one is served)."""
    from precompile.runtime._decode_loop import decode_loop

    model = build("llama")
    calls: list[dict[str, Any]] = []

    def call(**arguments: Any) -> Any:
        calls.append(arguments)
        with torch.no_grad():
            return model(**arguments)

    names = ["input_ids", "past_key_values", "attention_mask", "use_cache"]
    prompt = torch.randint(1, VOCAB, (2, 5))
    from precompile.runtime._sampling import Sampling

    options: dict[str, Any] = dict(max_new_tokens=2, sampling=Sampling())
    padded = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(precompile.InvalidOptionError, match="needs position_ids"):
        decode_loop(call, names, {}, prompt, new_cache(model), attention_mask=padded, **options)
    assert calls == []
    unpadded = torch.ones(2, 5, dtype=torch.long)
    out = decode_loop(call, names, {}, prompt, new_cache(model), attention_mask=unpadded,
                      **options)  # fmt: skip
    assert out.shape == (2, 7) and calls[0]["attention_mask"].shape == (2, MAX_CACHE)


def test_a_deep_copy_inside_serve_generate_runs_its_own_weights() -> None:
    """``copy.deepcopy(model)`` inside the block kept the router as the copy's
    ``forward``: the copy ran compiled models bound to the original (0.63 off its own
    eager outputs once its weights changed). A copy now runs its class's own forward."""
    import copy

    from tiny_models_helpers import VOCAB, tiny_llama

    model = tiny_llama().eval()
    ids = torch.randint(0, VOCAB, (1, 5))
    with precompile.serve_generate(model), torch.no_grad():
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for parameter in twin.parameters():
                parameter.mul_(1.5)
        assert "forward" in vars(model)  # the original is still served
        forward = twin.forward
        assert getattr(forward, "__self__", None) is twin
        assert getattr(forward, "__func__", None) is type(twin).forward
        expected = type(twin).forward(twin, input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(twin(input_ids=ids, use_cache=False).logits, expected)
        assert twin.get_compiled_call.__self__ is twin
    assert "forward" not in vars(model)


def test_the_first_request_with_a_bad_token_is_refused_by_name() -> None:
    """A token outside the vocabulary in the first request of a call structure raised
    eager's IndexError from the compile's own eager run; every later request is refused
    with ``IndexOutOfRangeError`` naming ``input_ids``: so is the first, before tracing."""
    from tiny_models_helpers import VOCAB, tiny_llama

    model = tiny_llama().eval()
    bad = torch.tensor([[1, 2, VOCAB + 3]])
    with precompile.serve_generate(model) as served, torch.no_grad():
        with pytest.raises(precompile.IndexOutOfRangeError, match=f"input_ids holds {VOCAB + 3}"):
            model.generate(input_ids=bad, max_new_tokens=2, do_sample=False,
                           cache_implementation="static")  # fmt: skip
        # nothing was traced for it, on the compiled loop (the default) or the router
        assert not served.compiled and served.loops is not None and not served.loops.compiled


def test_a_cache_holding_a_longer_unrelated_prompt_is_refused_by_name() -> None:
    """A ``StaticCache`` left holding another request's tokens: transformers' generate
    passes the prompt past them, no tokens at all, and eager fails inside the model; the
    router refused it only after a failed trace (a 3,400-character Dynamo error). Now it
    is refused by name before anything is traced."""
    from tiny_models_helpers import VOCAB, tiny_llama

    model = tiny_llama().eval()
    torch.manual_seed(3)
    first, second = torch.randint(3, VOCAB, (1, 7)), torch.randint(3, VOCAB, (1, 5))
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    options = {"past_key_values": cache, "max_new_tokens": 4, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(first, **options)  # leaves 10 tokens in the cache
        with pytest.raises(RuntimeError, match="0 elements"):  # eager
            model.generate(second, **options)
        held = r"no tokens past the 10 tokens its KV cache holds"
        refused = pytest.raises(precompile.InputMismatchError, match=held)
        with precompile.serve_generate(model, cache=False) as served:
            with refused:
                model.generate(second, **options)
            no_rows = torch.zeros(0, 5, dtype=torch.long)  # eager: the same reshape error
            with pytest.raises(precompile.InputMismatchError, match="a batch of no rows"):
                model.generate(no_rows, max_new_tokens=2, cache_implementation="static")
    assert not served.compiled and served.loops is not None and not served.loops.compiled


def test_a_cache_of_another_batch_is_refused_by_name_before_anything_runs() -> None:
    """A cache first written at batch 1 (``reset()`` keeps that batch) passed with a call
    of batch 2: eager fails inside the model (``index_copy_``), and the compile failed in
    Dynamo's trace with a raw ``TorchRuntimeError`` (a docs-only client trial, through
    ``serve_generate``). Refused by name, before any trace."""
    from tiny_models_helpers import VOCAB, tiny_llama

    model = tiny_llama().eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 3)), past_key_values=cache)
    cache.reset()
    call = {"input_ids": torch.randint(0, VOCAB, (2, 3)), "past_key_values": cache,
            "use_cache": True}  # fmt: skip
    with pytest.raises(precompile.InputMismatchError, match="holds a batch of 1") as refused:
        precompile.compile_model(model, (), call, cache=False)
    assert (refused.value.expected, refused.value.got) == (2, 1)


def test_a_passed_cache_serves_one_generate_at_a_time_on_either_loop() -> None:
    """Two threads generating into one passed cache: the compiled loop refused the
    second, which then fell back to transformers' loop and wrote the cache under the
    first (a docs-only client trial: both requests failed, and a trace under the race
    left a refusal that stuck for the block). The second is refused, on any loop."""
    import threading

    from tiny_models_helpers import VOCAB, tiny_llama

    model = tiny_llama().eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    entered, leave = threading.Event(), threading.Event()

    class Holding:  # a streamer: transformers' loop, which shows it the prompt first
        def put(self, value: Any) -> None:
            entered.set()
            leave.wait(30)
            raise KeyboardInterrupt("the test's own stop")  # before any forward

        def end(self) -> None:
            pass

    stopped: list[BaseException] = []

    def first() -> None:
        try:
            model.generate(torch.randint(3, VOCAB, (1, 4)), past_key_values=cache,
                           max_new_tokens=2, streamer=Holding())  # fmt: skip
        except BaseException as exc:
            stopped.append(exc)

    with precompile.serve_generate(model, cache=False) as served, torch.no_grad():
        thread = threading.Thread(target=first)
        thread.start()
        assert entered.wait(30)
        try:
            with pytest.raises(precompile.InvalidOptionError, match="another generate"):
                model.generate(torch.randint(3, VOCAB, (1, 4)), past_key_values=cache,
                               max_new_tokens=2)  # fmt: skip
        finally:
            leave.set()
            thread.join(30)
        assert [type(e) for e in stopped] == [KeyboardInterrupt]
        assert not served.compiled and served.loops is not None and not served.loops.compiled
