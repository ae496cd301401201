"""``CompiledModel.generate``: prefill, then one token per step against a static KV cache,
every forward call served by the compiled model (no Dynamo, no compile, no transformers
``generate`` machinery in between).

What it drives is what the model was compiled for: a keyword call of ``input_ids`` and
``past_key_values`` (a ``StaticCache``), with ``use_cache``, ``cache_position``,
``attention_mask`` and ``position_ids`` where the compiled call has them. Prompts of
different lengths come left-padded with a 2-d ``attention_mask``; the loop keeps it as one
``[batch, max_cache_len]`` buffer (ones where a token is, written in place each step, so
every call has one shape and CUDA graphs replay) and gives ``position_ids`` as
transformers' ``generate`` does (the mask's running count - 1; 1 at padding). Tokens stay
on the device; choosing them follows transformers' ``generate`` (greedy: the argmax; sampling:
temperature, then top-k, then top-p, then ``torch.multinomial``), so greedy tokens equal
its own. Stopping at EOS reads the device once per step on the CPU and once every
``_SYNC_EVERY`` steps on a GPU (the steps after every row finished are cut from the output,
so it is the same either way).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from ._errors import InvalidOptionError
from ._kv_cache import is_kv_cache, kv_cache_capacity

_DRIVEN = (
    "input_ids",
    "past_key_values",
    "use_cache",
    "cache_position",
    "attention_mask",
    "position_ids",
)
_SYNC_EVERY = 8  # GPU steps between reads of "has every row finished"


def check_sampling(
    do_sample: bool, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if not isinstance(do_sample, bool):
        raise InvalidOptionError(f"do_sample must be True or False, got {do_sample!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (temperature > 0)
    ):
        raise InvalidOptionError(f"temperature must be a number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InvalidOptionError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise InvalidOptionError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def next_tokens(
    logits: torch.Tensor,
    *,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row from the last position's logits, as transformers chooses it."""
    scores = logits[:, -1, :].to(dtype=torch.float32, copy=True)
    if not do_sample:
        return scores.argmax(dim=-1)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False  # the likeliest token is always kept
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    probabilities = scores.softmax(dim=-1)
    return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device: torch.device) -> torch.Tensor:
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ())
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidOptionError(
                f"eos_token_id must be a token id (an int >= 0) or a list of them, got "
                f"{eos_token_id!r}"
            )
    return torch.tensor(ids, dtype=torch.long, device=device)


def _mask_buffer(
    attention_mask: torch.Tensor | None,
    names: Collection[str],
    input_ids: torch.Tensor,
    capacity: int | None,
) -> torch.Tensor | None:
    """The ``[batch, max_cache_len]`` mask the compiled calls take (the prompt's mask, then
    zeros the steps fill with ones), or None where the model takes no mask."""
    if "attention_mask" not in names:
        if attention_mask is not None:
            raise InvalidOptionError(
                "attention_mask was passed, but this model was compiled without one: "
                "compile it with an attention_mask of shape [batch, max_cache_len] to serve "
                "padded prompts"
            )
        if "position_ids" in names:
            raise InvalidOptionError(
                "this model was compiled with position_ids and no attention_mask; generate "
                "derives the positions from the mask: compile it with both"
            )
        return None
    if capacity is None:
        raise InvalidOptionError(
            "generate with an attention_mask needs a cache with a max_cache_len"
        )
    batch, length = input_ids.shape
    if attention_mask is None:
        prompt = torch.ones(batch, length, dtype=torch.long, device=input_ids.device)
    else:
        if (
            not isinstance(attention_mask, torch.Tensor)
            or tuple(attention_mask.shape) != (batch, length)
            or attention_mask.dtype not in (torch.long, torch.int32, torch.bool)
            or attention_mask.device != input_ids.device
        ):
            raise InvalidOptionError(
                "attention_mask must be a [batch, length] int64, int32 or bool tensor on "
                f"input_ids' device, shaped as input_ids {list(input_ids.shape)}, got "
                f"{_described(attention_mask)}"
            )
        prompt = attention_mask.to(torch.long)
        bad = ((prompt != 0) & (prompt != 1)).any() | (prompt[:, -1] != 1).any()
        bad, padded = torch.stack([bad, (prompt == 0).any()]).tolist()  # one read
        if bad:
            raise InvalidOptionError(
                "attention_mask must hold only 0 and 1 and end every row with a token (1): "
                "generate pads prompts on the left"
            )
        if padded and "position_ids" not in names:
            raise InvalidOptionError(
                "a padded attention_mask needs position_ids in the compiled call: "
                "transformers' generate derives them from the mask, and without them the "
                "model counts positions from the cache, so padded rows would answer "
                "otherwise; compile the model with position_ids"
            )
    mask = torch.zeros(batch, capacity, dtype=torch.long, device=input_ids.device)
    mask[:, :length] = prompt
    return mask


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)} on {value.device}"
    return type(value).__name__


def decode_loop(
    call: Callable[..., Any],
    names: Collection[str],
    constants: Mapping[str, Any],
    input_ids: torch.Tensor,
    cache: Any,
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
    attention_mask: torch.Tensor | None = None,
    held: Callable[[Any], int] | None = None,
) -> torch.Tensor:
    """The prompt followed by up to ``max_new_tokens`` tokens per row (``[batch, prompt +
    new]``, on the prompt's device). ``call`` is the compiled model, compiled for a
    keyword call of ``names`` (``constants``: the plain values it was compiled with);
    ``held``: the tokens a cache holds (a cache that holds any is refused before a step)."""
    unknown = sorted(set(names) - set(_DRIVEN))
    if unknown or "input_ids" not in names or "past_key_values" not in names:
        raise InvalidOptionError(
            "generate drives keyword calls of input_ids and past_key_values (and use_cache, "
            "cache_position, attention_mask and position_ids where compiled with them); this "
            "model was compiled for "
            f"{sorted(names)}; compile it for such a call"
        )
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or (input_ids.dtype != torch.long)
    ):
        raise InvalidOptionError(
            f"input_ids must be a [batch, length] int64 tensor, got {_described(input_ids)}"
        )
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise InvalidOptionError(f"input_ids must hold a prompt, got shape {list(input_ids.shape)}")
    if not is_kv_cache(cache):
        raise InvalidOptionError(
            f"past_key_values must be a transformers StaticCache, got {type(cache).__name__}"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or (max_new_tokens < 1)
    ):
        raise InvalidOptionError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_sampling(do_sample, temperature, top_k, top_p)
    device = input_ids.device
    eos = _eos_tensor(eos_token_id, device)
    if eos.numel() and (
        pad_token_id is None
        or isinstance(pad_token_id, bool)
        or not isinstance(pad_token_id, int)
        or pad_token_id < 0
    ):
        raise InvalidOptionError(
            "pad_token_id (a token id, an int >= 0) is needed with eos_token_id: rows that "
            f"finished are filled with it; got {pad_token_id!r}"
        )
    total = length + max_new_tokens
    capacity = kv_cache_capacity(cache)
    if capacity is not None and total - 1 > capacity:
        raise InvalidOptionError(
            f"the cache holds {capacity} tokens, and a prompt of {length} with "
            f"max_new_tokens={max_new_tokens} writes {total - 1}; pass a larger cache or "
            "ask for fewer tokens"
        )
    filled = held(cache) if held is not None else 0
    if filled:
        raise InvalidOptionError(
            f"past_key_values already holds {filled} tokens: generate starts from an empty "
            "cache (the prompt is the whole context); pass a fresh cache or reset() this one"
        )
    mask = _mask_buffer(attention_mask, names, input_ids, capacity)
    positions = input_ids  # replaced at the prefill where position_ids are given
    tokens = torch.empty(batch, total, dtype=torch.long, device=device)
    tokens[:, :length] = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    sync_every = 1 if device.type == "cpu" else _SYNC_EVERY
    start, written = 0, length
    step_ids = input_ids
    for step in range(max_new_tokens):
        end = start + step_ids.shape[1]
        arguments: dict[str, Any] = {"input_ids": step_ids, "past_key_values": cache}
        if "use_cache" in names:
            arguments["use_cache"] = constants.get("use_cache", True)
        if "cache_position" in names:
            arguments["cache_position"] = torch.arange(start, end, device=device)
        if mask is not None:
            if step:  # the prompt's columns hold its own mask
                mask[:, start:end] = 1
            arguments["attention_mask"] = mask
            if "position_ids" in names:
                if step:  # one token more per row: its position follows the last one
                    positions = positions[:, -1:] + 1
                else:  # the prompt's: the running count of its tokens - 1, 1 at padding
                    counts = mask[:, :end].cumsum(dim=-1) - 1
                    positions = counts.masked_fill(mask[:, :end] == 0, 1)
                arguments["position_ids"] = positions
        out = call(**arguments)
        chosen = next_tokens(out.logits, do_sample=do_sample, temperature=temperature,
                             top_k=top_k, top_p=top_p, generator=generator)  # fmt: skip
        if eos.numel():
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad_token_id or 0))
            unfinished &= ~torch.isin(chosen, eos)
        tokens[:, written] = chosen
        written += 1
        start, step_ids = end, chosen[:, None]
        last = step == max_new_tokens - 1
        if eos.numel() and not last and (step + 1) % sync_every == 0 and not bool(unfinished.any()):
            break
    out_tokens = tokens[:, :written]
    if eos.numel() and sync_every > 1:
        # Steps run after every row had finished (between two reads) are cut: the output
        # ends where transformers' would, at the step the last row finished.
        finished_at = (out_tokens[:, length:][..., None] == eos).any(-1).long()
        done = finished_at.cummax(dim=-1).values.all(dim=0).nonzero()
        if done.numel():
            out_tokens = out_tokens[:, : length + int(done[0]) + 1]
    return out_tokens
