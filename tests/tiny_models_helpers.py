"""The tiny random-initialized ``transformers`` models the tests build (from small
configs, nothing downloaded): Llama, GPT-2, BERT, OPT, the decoder kinds of the model
kinds table and the encoder-decoders."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
SIZES = [(1, 7), (1, 3), (1, 30), (1, 1), (2, 9), (3, 100)]


# the tiny decoders' sizes: one layer, two heads sharing one KV head
_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
}


def tiny_llama(**changes: Any) -> torch.nn.Module:
    """The tiny Llama; ``changes``: config fields set otherwise."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**_TINY, **changes})
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=512,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    return transformers.BertModel(config).eval()


def tiny_opt() -> torch.nn.Module:
    """OPT: learned positions computed from the attention mask's cumulative sum."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
        pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config).eval()


def tiny_encoder_decoders() -> dict[str, torch.nn.Module]:
    """T5 and BART: generate hands their forward an ``EncoderDecoderCache``."""
    torch.manual_seed(0)
    bart = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    t5 = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    return {
        "bart": transformers.BartForConditionalGeneration(bart).eval(),
        "t5": transformers.T5ForConditionalGeneration(t5).eval(),
    }


# the Llama's sizes (``_TINY``); the kinds with a sliding window have a window shorter
# than the cache generate makes, so their caches have sliding-window layers
_DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 1}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 4}),
}


def tiny_decoder(kind: str) -> torch.nn.Module:
    """A causal LM of ``kind`` (a key of ``_DECODERS``), built with ``AutoModelForCausalLM``."""
    torch.manual_seed(0)
    name, own = _DECODERS[kind]
    config = getattr(transformers, name)(**{**_TINY, **own})
    return transformers.AutoModelForCausalLM.from_config(config).eval()
