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

import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ._cudagraphs import plain_calls
from ._decode_graphs import GraphedSteps, StepBuffers
from ._errors import InvalidOptionError
from ._kv_cache import cache_tensors, is_kv_cache, kv_cache_capacity
from ._sampling import Sampling

_DRIVEN = (
    "input_ids",
    "past_key_values",
    "use_cache",
    "cache_position",
    "attention_mask",
    "position_ids",
)
_SYNC_EVERY = 8  # GPU steps between reads of "has every row finished"


def _eos_tensor(eos_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(eos_ids), dtype=torch.long, device=device)


# The caches a generate is writing now: one cache serves one generate at a time (two
# would race on its tokens, and on the check that it starts empty).
_WRITING: set[int] = set()
_WRITING_LOCK = threading.Lock()


@contextlib.contextmanager
def _writing(cache: Any) -> Iterator[None]:
    with _WRITING_LOCK:
        if id(cache) in _WRITING:
            raise InvalidOptionError(
                "past_key_values is being written by another generate (in another thread): "
                "a cache serves one generate at a time; give each its own cache"
            )
        _WRITING.add(id(cache))
    try:
        yield
    finally:
        with _WRITING_LOCK:
            _WRITING.discard(id(cache))


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


def _cache_addresses(cache: Any) -> tuple[int, ...]:
    """The data addresses of a cache's tensors (a step graph writes them in place)."""
    return tuple(tensor.data_ptr() for _, _, tensor in cache_tensors(cache))


def step_graph_key(batch: int, names: Collection[str], cache: Any, sampling: Sampling) -> Hashable:
    """What a decode-step graph of a generate bakes in, so what a kept one is found by: the
    batch, the call's arguments, the choice and stopping settings (``Sampling.key``) and
    the cache's addresses."""
    return (batch, tuple(names), sampling.key(), _cache_addresses(cache))


def _on(generator: torch.Generator, device: torch.device) -> bool:
    """Whether ``generator`` draws for ``device``: ``torch.Generator(device="cuda")`` says no
    index (it serves whichever device it is used on), a tensor's device always has one."""
    where = generator.device
    return where.type == device.type and where.index in (None, device.index)


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
    sampling: Sampling,
    attention_mask: torch.Tensor | None = None,
    held: Callable[[Any], int] | None = None,
    graphed: GraphedSteps | None = None,
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
    device = input_ids.device
    sampling.check_device(device)
    eos = _eos_tensor(sampling.eos_token_id, device)
    total = length + max_new_tokens
    capacity = kv_cache_capacity(cache)
    if capacity is not None and total - 1 > capacity:
        raise InvalidOptionError(
            f"the cache holds {capacity} tokens, and a prompt of {length} with "
            f"max_new_tokens={max_new_tokens} writes {total - 1}; pass a larger cache or "
            "ask for fewer tokens"
        )
    with _writing(cache):
        filled = held(cache) if held is not None else 0
        if filled:
            raise InvalidOptionError(
                f"past_key_values already holds {filled} tokens: generate starts from an empty "
                "cache (the prompt is the whole context); pass a fresh cache or reset() this one"
            )
        mask = _mask_buffer(attention_mask, names, input_ids, capacity)
        choose, fill, generator = sampling.choose, sampling.fill, sampling.generator
        tokens = torch.empty(batch, total, dtype=torch.long, device=device)
        tokens[:, :length] = input_ids
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        sync_every = 1 if device.type == "cpu" else _SYNC_EVERY

        # The prefill: the prompt, every row's positions from its mask.
        arguments: dict[str, Any] = {"input_ids": input_ids, "past_key_values": cache}
        if "use_cache" in names:
            arguments["use_cache"] = constants.get("use_cache", True)
        if "cache_position" in names:
            arguments["cache_position"] = torch.arange(0, length, device=device)
        positions = None
        if mask is not None:
            arguments["attention_mask"] = mask
            if "position_ids" in names:
                # the running count of the prompt's tokens - 1, 1 at padding
                counts = mask[:, :length].cumsum(dim=-1) - 1
                positions = counts.masked_fill(mask[:, :length] == 0, 1)
                arguments["position_ids"] = positions
        chosen = choose(call(**arguments).logits, generator=generator)
        if eos.numel():
            unfinished &= ~torch.isin(chosen, eos)
        tokens[:, length] = chosen
        written = length + 1

        def all_finished(step: int, flags: torch.Tensor) -> bool:
            """Whether to stop after ``step`` (0: the prefill): every row at EOS, read once
            every ``sync_every`` steps (never after the last, which stops anyway)."""
            return (
                bool(eos.numel())
                and step < max_new_tokens - 1
                and (step + 1) % sync_every == 0
                and not bool(flags.any())
            )

        if max_new_tokens == 1 or all_finished(0, unfinished):
            return _cut_after_eos(tokens[:, :written], eos, length, sync_every)

        # The decode steps: one token per row, every step on the same buffers, advanced in
        # place (the step a graph captures).
        def step_arguments(b: StepBuffers) -> dict[str, Any]:
            found: dict[str, Any] = {"input_ids": b.ids, "past_key_values": cache}
            if "use_cache" in names:
                found["use_cache"] = constants.get("use_cache", True)
            if "cache_position" in names:
                found["cache_position"] = b.position
            if b.mask is not None:
                found["attention_mask"] = b.mask
            if b.positions is not None:
                found["position_ids"] = b.positions
            return found

        def decode_step(
            b: StepBuffers, forward: Callable[..., Any], drawn: torch.Generator | None
        ) -> None:
            if b.mask is not None:
                b.mask.index_fill_(1, b.position, 1)
            if b.positions is not None:
                b.positions.add_(1)  # one token more per row: its position follows the last
            chosen = choose(forward(**step_arguments(b)).logits, generator=drawn)
            if b.eos.numel():
                chosen = torch.where(b.unfinished, chosen, torch.full_like(chosen, fill))
                b.unfinished &= ~torch.isin(chosen, b.eos)
            b.ids.copy_(chosen[:, None])
            b.position.add_(1)

        # A graph draws from a generator of its own (a graph bakes in the generator it was
        # captured with): given the caller's state before its steps, and the state after them
        # given back, so the caller's generator advances as eager's would. Without one, the
        # default generator (which registers itself with every graph).
        own_generator = sampling.own_generator
        if own_generator and generator is not None and not _on(generator, device):
            graphed = None  # the eager path raises torch's own error for it
        key = step_graph_key(batch, names, cache, sampling)
        graph = None
        if graphed is not None and not graphed.graphs.refused(key):
            graph = graphed.graphs.take(key)
        if graph is not None and graphed is not None:
            buffers = graph.buffers  # the graph's own: this generate's values copied in
            buffers.ids.copy_(chosen[:, None])
            buffers.position.fill_(length)
            buffers.unfinished.copy_(unfinished)
            if buffers.mask is not None and mask is not None:
                buffers.mask.copy_(mask)
            if buffers.positions is not None and positions is not None:
                buffers.positions.copy_(positions[:, -1:])
            if not graphed.graphs.current(graph, key, step_arguments(buffers)):
                graph = None
        drawn = generator if sampling.do_sample else None  # what the steps draw from
        if graph is not None:
            drawn = graph.generator if own_generator else drawn
        elif graphed is not None and own_generator:
            drawn = torch.Generator(device=device)
        if drawn is not None and drawn is not generator and generator is not None:
            drawn.set_state(generator.get_state())
        if graph is None:
            buffers = StepBuffers(
                ids=chosen[:, None].clone(),
                position=torch.full((1,), length, dtype=torch.long, device=device),
                unfinished=unfinished,
                eos=eos,
                mask=mask,
                positions=None if positions is None else positions[:, -1:].clone(),
            )
        unguarded = False  # steps ran where the cache guard's mirror did not see them
        try:
            for step in range(1, max_new_tokens):
                if graph is not None:
                    graph.graph.replay()
                    unguarded = True
                elif graphed is not None and step >= 2 and not graphed.graphs.refused(key):
                    unguarded = True
                    graph = graphed.graphs.capture(
                        key,
                        functools.partial(decode_step, buffers, graphed.call, drawn),
                        buffers,
                        step_arguments(buffers),
                        drawn if own_generator else None,
                    )  # ran this step, then captured it for the next ones
                elif graphed is not None and not graphed.graphs.refused(key):
                    with plain_calls():  # checked, not captured by the per-size graphs
                        decode_step(buffers, call, drawn)
                else:
                    decode_step(buffers, call, drawn)
                tokens[:, written] = buffers.ids[:, 0]
                written += 1
                if all_finished(step, buffers.unfinished):
                    break
        finally:
            if drawn is not None and drawn is not generator and generator is not None:
                generator.set_state(drawn.get_state())  # the caller's, advanced as eager's
            if graph is not None and graphed is not None:
                graphed.graphs.give(graph)
            if unguarded and graphed is not None:
                graphed.stale(cache)
        return _cut_after_eos(tokens[:, :written], eos, length, sync_every)


def _cut_after_eos(
    tokens: torch.Tensor, eos: torch.Tensor, length: int, sync_every: int
) -> torch.Tensor:
    """``tokens`` without the steps run after every row had finished (between two reads
    of it): the output ends where transformers' would, at the step the last row did."""
    if not eos.numel() or sync_every == 1:
        return tokens
    finished_at = (tokens[:, length:][..., None] == eos).any(-1).long()
    done = finished_at.cummax(dim=-1).values.all(dim=0).nonzero()
    if done.numel():
        return tokens[:, : length + int(done[0]) + 1]
    return tokens
