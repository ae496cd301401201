"""Compiling and warming up write none of the caller's state (issue 30).

``compile_model`` runs the model (its traced call; an eager run that initializes a KV
cache) and warm-up runs every variant with the model's own weights; a graph that writes
its inputs in place (a counter buffer, a gpt-fast KV cache held in buffers, a parameter,
a tensor argument) must still leave every parameter, buffer, argument and module
attribute as it was: the same tensor objects, bitwise the same values. Also: a model
called with grad enabled compiles (outputs equal to eager), or, where its call writes a
KV cache with values that require grad, is refused with a message saying to compile
under ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import precompile
from precompile.runtime import UnsupportedGraphError

WIDTH = 8


@pytest.fixture(autouse=True)
def _warm_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A background warm-up starts at once (not after a second's grace for a first call)."""
    monkeypatch.setenv("PRECOMPILE_WARMUP_GRACE", "0")


class Stateful(torch.nn.Module):
    """Writes its state on every call: a counter buffer, a parameter and its tensor
    argument ``acc``, each in place (a forward that writes a Python attribute is refused:
    tests/compile/test_trace_read.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.drift = torch.nn.Parameter(torch.zeros(WIDTH))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        self.drift.add_(0.5)  # a parameter written in place (callers run it under no_grad)
        acc.add_(x)
        return self.lin(x) * self.n + self.drift + acc


class KVDecoder(torch.nn.Module):
    """gpt-fast style: the k/v caches are buffers, written at ``input_pos`` by each call
    (``index_copy_`` and indexing), attention reads the positions up to each token's."""

    def __init__(self, vocab: int = 64, width: int = 16, length: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("k_cache", torch.zeros(1, length, width))
        self.register_buffer("v_cache", torch.zeros(1, length, width))
        self.register_buffer("slots", torch.arange(length))

    def forward(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        self.k_cache.index_copy_(1, input_pos, k)
        self.v_cache[:, input_pos] = v
        scores = q @ self.k_cache.transpose(1, 2) / q.shape[-1] ** 0.5
        visible = self.slots[None, :] <= input_pos[:, None]
        attended = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ self.v_cache
        return self.head(attended)  # the tokens depend on every cached position


def snapshot(model: torch.nn.Module, *tensors: torch.Tensor) -> dict[str, Any]:
    """Every parameter and buffer (object and a copy of its value), the given tensors, and
    the module's plain attributes."""
    state: dict[str, Any] = {
        name: (t, t.detach().clone(), t.requires_grad)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    for index, tensor in enumerate(tensors):
        state[f"argument {index}"] = (tensor, tensor.detach().clone(), tensor.requires_grad)
    state["attributes"] = {
        k: v for k, v in vars(model).items() if isinstance(v, (bool, int, float, str))
    }
    return state


def assert_unchanged(model: torch.nn.Module, before: dict[str, Any], *tensors: Any) -> None:
    """The same tensor objects as ``before``, bitwise equal, the same requires_grad."""
    now = dict(model.named_parameters())
    now.update(model.named_buffers())
    now.update({f"argument {i}": t for i, t in enumerate(tensors)})
    for name, (tensor, value, grad) in ((k, v) for k, v in before.items() if k != "attributes"):
        assert now[name] is tensor, f"{name} was replaced"
        assert tensor.requires_grad == grad, f"{name}'s requires_grad changed"
        assert tensor.grad_fn is None, f"{name} has autograd history"
        assert torch.equal(tensor.detach(), value), f"{name} was written"
    attributes = {k: v for k, v in vars(model).items() if isinstance(v, (bool, int, float, str))}
    assert attributes == before["attributes"]


# -- a counter buffer, a parameter and an argument written in place ---------------------
def stateful_model() -> Stateful:
    torch.manual_seed(0)
    return Stateful().eval()


def stateful_calls(call: Callable[..., Any], count: int = 3) -> list[torch.Tensor]:
    """``count`` calls at lengths 4, 3, 5 (a fresh ``acc`` each), under no_grad."""
    torch.manual_seed(1)
    outputs = []
    with torch.no_grad():
        for length in (4, 3, 5)[:count]:
            x, acc = torch.randn(length, WIDTH), torch.randn(length, WIDTH)
            outputs.append(call(x, acc))
    return outputs


STATEFUL_EXAMPLE = (torch.randn(4, WIDTH), torch.randn(4, WIDTH))
STATEFUL_OPTIONS: dict[str, Any] = dict(dynamic={0: [0], 1: [0]}, hints=[4], sizes=[])


@pytest.fixture(scope="module")
def stateful(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One compile (warm-up in the foreground), its cache and its saved file; the model's
    and the example's state before it and after it."""
    root = tmp_path_factory.mktemp("caller-state")
    model = stateful_model()
    x, acc = (t.clone() for t in STATEFUL_EXAMPLE)
    before = snapshot(model, x, acc)
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (x, acc), **STATEFUL_OPTIONS, cache=str(root / "cache"), warmup=True
        )
    after_compile = snapshot(model, x, acc)
    path = root / "stateful.pt2"
    compiled.save(path)
    return {"model": model, "compiled": compiled, "before": before, "args": (x, acc),
            "after": after_compile, "cache": str(root / "cache"), "path": path}  # fmt: skip


def test_compile_and_warm_up_write_no_buffer_parameter_argument_or_attribute(
    stateful: dict[str, Any],
) -> None:
    assert_unchanged(stateful["model"], stateful["before"], *stateful["args"])


def test_the_counter_counts_from_one_as_eager_does(stateful: dict[str, Any]) -> None:
    eager = stateful_model()
    want = stateful_calls(eager)
    got = stateful_calls(stateful["compiled"])
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected)
    # and the compiled calls wrote the model's state as eager's did
    assert torch.equal(stateful["model"].n, eager.n)
    assert torch.equal(stateful["model"].drift, eager.drift)


@pytest.mark.parametrize("warmup", [True, "background"])
def test_a_fresh_load_with_warm_up_writes_nothing(stateful: dict[str, Any], warmup: Any) -> None:
    model = stateful_model()
    before = snapshot(model)
    loaded = precompile.load_model(model, stateful["path"], warmup=warmup)
    loaded.wait_warm()
    assert_unchanged(model, before)
    want = stateful_calls(stateful_model())
    for have, expected in zip(stateful_calls(loaded), want, strict=True):
        torch.testing.assert_close(have, expected)


@pytest.mark.parametrize("compile", [True, False])
def test_a_cache_hit_and_its_warm_up_write_nothing(stateful: dict[str, Any], compile: bool) -> None:
    model = stateful_model()
    x, acc = (t.clone() for t in STATEFUL_EXAMPLE)
    before = snapshot(model, x, acc)
    with torch.no_grad():
        found = precompile.compile_model(
            model, (x, acc), **STATEFUL_OPTIONS, cache=stateful["cache"], compile=compile,
            warmup="background",
        )  # fmt: skip
    found.wait_warm()
    assert found.cache_key == stateful["compiled"].cache_key
    assert_unchanged(model, before, x, acc)


# -- a gpt-fast style KV cache held in buffers -----------------------------------------
PROMPT = torch.tensor([[3, 14, 15, 9]])


def prefilled_decoder() -> KVDecoder:
    """A decoder whose caches already hold a prompt (the caller's state)."""
    torch.manual_seed(0)
    model = KVDecoder().eval()
    with torch.no_grad():
        model(PROMPT, torch.arange(PROMPT.shape[1]))
    return model


def decode(call: Callable[..., Any], steps: int = 6) -> tuple[list[int], torch.Tensor]:
    """Greedy decode after the prompt, one token per call: the tokens and their logits."""
    token, position, tokens, logits = PROMPT[:, -1:], PROMPT.shape[1], [], []
    with torch.no_grad():
        for _ in range(steps):
            logits.append(call(token, torch.tensor([position]))[:, -1])
            token = logits[-1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            position += 1
    return tokens, torch.cat(logits)


def assert_decodes_as_eager(call: Callable[..., Any]) -> None:
    tokens, logits = decode(call)
    want_tokens, want_logits = decode(prefilled_decoder())
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The prefilled decoder compiled from another call at positions 0..3 (what the
    trace writes there must not stay), warm-up in the foreground."""
    model = prefilled_decoder()
    before = snapshot(model)
    example = (torch.tensor([[1, 2, 3, 4]]), torch.arange(4))
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, example, dynamic={0: [1], 1: [0]}, hints=[4], cache=False, warmup=True
        )
    path = tmp_path_factory.mktemp("decoder") / "decoder.pt2"
    compiled.save(path)
    return {"model": model, "compiled": compiled, "before": before, "path": path}


def test_compiling_a_decoder_leaves_its_kv_cache_buffers(decoder: dict[str, Any]) -> None:
    assert_unchanged(decoder["model"], decoder["before"])


def test_greedy_decode_after_compile_matches_eager(decoder: dict[str, Any]) -> None:
    assert_decodes_as_eager(decoder["compiled"])


@pytest.mark.parametrize("warmup", [True, "background"])
def test_greedy_decode_after_a_fresh_load_matches_eager(
    decoder: dict[str, Any], warmup: Any
) -> None:
    model = prefilled_decoder()
    before = snapshot(model)
    loaded = precompile.load_model(model, decoder["path"], warmup=warmup)
    loaded.wait_warm()
    assert_unchanged(model, before)
    assert_decodes_as_eager(loaded)


@pytest.mark.slow
def test_a_decoder_writing_its_buffers_with_grad_enabled_is_refused_untouched() -> None:
    """Under grad, the call writes the cache buffers with values that require grad: a
    second call would pass them requiring grad, which the compiled graph does not take."""
    model = prefilled_decoder()
    before = snapshot(model)
    with pytest.raises(UnsupportedGraphError, match=r"k_cache.*torch\.no_grad\(\)"):
        precompile.compile_model(
            model, (torch.tensor([[1, 2, 3, 4]]), torch.arange(4)), dynamic={0: [1], 1: [0]},
            hints=[4], sizes=[], cache=False, warmup=False,
        )  # fmt: skip
    assert_unchanged(model, before)


# -- transformers models called with grad enabled -------------------------------------
transformers = pytest.importorskip("transformers")
VOCAB = 128


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                  max_position_embeddings=64)  # fmt: skip
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        return transformers.Qwen2ForCausalLM(config).eval()
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB,
                                     n_positions=64)  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_grad_enabled_compile_matches_eager(arch: str) -> None:
    model = tiny(arch)
    ids = torch.randint(0, VOCAB, (1, 7))
    before = snapshot(model)
    # Llama's compile traces length 1 apart too (with its backward); the others declare
    # lengths of 2 and more, the lengths called below, and are one trace each
    lengths: Any = [1] if arch == "llama" else {1: (2, None)}
    compiled = precompile.compile_model(
        model, (), {"input_ids": ids, "use_cache": False}, dynamic={"input_ids": lengths},
        hints=[8], sizes=[], cache=False, warmup=True,
    )  # fmt: skip
    assert_unchanged(model, before)
    # the backward too, at lengths other than the hint's: it had been compiled with the
    # saved activations' strides at the hint ("expected size 5==5, stride 5==8")
    for length in (7, 5, 13):
        call = {"input_ids": torch.randint(0, VOCAB, (1, length)), "use_cache": False}
        got, want = compiled(**call).logits, model(**call).logits
        assert got.requires_grad and want.requires_grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        ours = torch.autograd.grad(got.square().sum(), list(model.parameters()))
        eager = torch.autograd.grad(want.square().sum(), list(model.parameters()))
        for a, b in zip(ours, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_grad_enabled_compile_with_a_static_cache_is_refused_before_tracing(arch: str) -> None:
    model = tiny(arch)
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    call = {"input_ids": torch.randint(0, VOCAB, (1, 7)), "past_key_values": cache,
            "use_cache": True}  # fmt: skip
    before = snapshot(model)
    with pytest.raises(UnsupportedGraphError, match=r"torch\.no_grad\(\)") as refused:
        precompile.compile_model(model, (), call, dynamic={"input_ids": [1]}, cache=False)
    assert "past_key_values" in str(refused.value)
    assert not any(layer.is_initialized for layer in cache.layers)  # refused before any run
    assert_unchanged(model, before)
