"""The decode tests' models and loop: a tiny Llama or Qwen2 (biased q/k/v projections),
a transformers ``StaticCache`` for it, and greedy decoding on a callable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
STEPS = 32
MAX_CACHE = 64


def _config(name: str) -> Any:
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    if name == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common, use_sliding_window=False)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = _config(name)
    cls = transformers.LlamaForCausalLM if name == "llama" else transformers.Qwen2ForCausalLM
    return cls(config).eval()


def new_cache(model: torch.nn.Module, batch: int | None = None, **kwargs: Any) -> Any:
    cache = transformers.StaticCache(
        config=model.config, max_cache_len=kwargs.pop("length", MAX_CACHE)
    )
    if batch is not None:  # else the first write initializes it (lazily, as in eager)
        cache.early_initialization(batch, 1, 16, kwargs.get("dtype", torch.float32),
                                   torch.device(kwargs.get("device", "cpu")))  # fmt: skip
    return cache


def greedy(call: Callable[..., Any], model: torch.nn.Module, prompt: torch.Tensor,
           positions: bool = False) -> torch.Tensor:  # fmt: skip
    """Prefill, then STEPS greedy decode steps, the cache written in place."""
    cache = new_cache(model)
    tokens, start = prompt, 0
    generated = []
    with torch.no_grad():
        for _ in range(STEPS + 1):
            extra = {"cache_position": torch.arange(start, start + tokens.shape[1])}
            out = call(input_ids=tokens, past_key_values=cache, use_cache=True,
                       **(extra if positions else {}))  # fmt: skip
            assert out.past_key_values is cache
            start += tokens.shape[1]
            tokens = out.logits[:, -1:].argmax(-1)
            generated.append(tokens)
    assert int(cache.layers[-1].cumulative_length) == prompt.shape[1] + STEPS
    return torch.cat(generated, dim=1)
