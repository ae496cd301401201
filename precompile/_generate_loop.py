"""``serve_generate``'s compiled loop (``loop=True``, its default): a ``model.generate()``
call the compiled decode loop can answer runs on it (``CompiledModel.generate``) instead of
transformers' loop.

transformers' ``generate`` spends its time per step in Python around the forward (input
preparation, mask building, logits processors, stopping criteria): served per forward,
a token costs about three times what the compiled loop's step does. A call is answered
by the compiled loop when everything it asks for is something that loop does exactly as
transformers does it: greedy, or sampling with temperature, top-k and top-p; EOS tokens
and padding after them; ``max_new_tokens`` (or ``max_length``); a static KV cache; one
prompt length per batch (no attention mask, or one of all ones); an empty
``StaticCache`` the call passes is used as it is. Anything else (beams,
other logits processors, a streamer, a padded batch...) goes to transformers' own loop,
each forward still served by a compiled model; the reason is logged (DEBUG) and counted
in ``served.stats``.

The effective settings are transformers' own: ``model._prepare_generation_config`` (the
model's ``generation_config``, transformers' global defaults, then the call's keywords),
so a default such as ``top_k=50`` when sampling applies here as there. A transformers
that lays it out otherwise sends every call to its own loop, named.

The compiled loop model is one ``compile_model`` per KV cache length (and batch size,
unless ``dynamic_batch``): the cache is a ``StaticCache`` of prompt + new tokens rounded
up to a power of two (at least 64), so requests of nearby lengths share a compiled model
and a cache. Caches are kept and ``reset()`` between requests (CUDA graphs captured on a
cache are replayed by the next request on it), at most ``kept_caches`` free ones besides
``prepare``'s; a request finding its cache in use by another thread gets a new one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from precompile.runtime import UnsupportedGraphError
from precompile.runtime.compiler_interface import is_kv_cache, kv_cache_capacity

# generate's own arguments the loop takes (the prompt, its mask, the config object), and
# the generation settings it implements; any other setting must be at its default.
_ARGUMENTS = frozenset({
    "input_ids", "inputs", "attention_mask", "generation_config", "past_key_values", "cache",
})  # fmt: skip
_SETTINGS = frozenset({
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id", "bos_token_id", "cache_implementation", "use_cache",
})  # fmt: skip
# Settings that change nothing the loop computes (what the forward returns besides the
# logits, bookkeeping of the config object itself).
_IGNORED = frozenset({
    "output_attentions", "output_hidden_states", "_from_model_config", "transformers_version",
    "decoder_start_token_id", "compile_config", "cache_config", "disable_compile",
})  # fmt: skip

log = logging.getLogger("precompile.compile")

# Free KV caches a block keeps besides prepare's, by default: as many as step graphs a
# compiled model keeps (runtime's DecodeGraphs), so a cache past the bound would have lost
# its graph anyway. A request whose cache was dropped allocates one and captures its step
# graph again (64-69 ms on an H200 for a first generate at a new batch; docs/decode.md).
KEPT_CACHES = 8


@dataclasses.dataclass(frozen=True)
class LoopRequest:
    """A ``generate`` call the compiled loop answers, with transformers' effective
    settings."""

    input_ids: torch.Tensor
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    kv_cache: Any = None  # the caller's StaticCache, where the call passes one

    @property
    def capacity(self) -> int:
        """The KV cache length it runs on: the caller's cache's, else prompt + new
        tokens, up to a power of two."""
        if self.kv_cache is not None:
            return int(kv_cache_capacity(self.kv_cache))  # type: ignore[arg-type]
        needed = int(self.input_ids.shape[1]) + self.max_new_tokens
        return max(64, 1 << (needed - 1).bit_length())

    def sampling(self) -> dict[str, Any]:
        """``CompiledModel.generate``'s keywords for the choice of tokens and stopping."""
        chosen: dict[str, Any] = {"do_sample": self.do_sample}
        if self.do_sample:  # transformers applies each warper only where it changes logits
            chosen["temperature"] = self.temperature
            chosen["top_k"] = self.top_k
            chosen["top_p"] = self.top_p
        return {**chosen, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}


def loop_request(
    model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> LoopRequest | str:
    """The call ``model.generate(*args, **kwargs)`` as the compiled loop runs it, or why
    transformers' loop must run it."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if len(args) > 1:
        return "positional arguments past input_ids"
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.dtype == torch.long):
        return "input_ids that are not a [batch, length] int64 tensor of token ids"
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        return "an empty prompt"
    mask = kwargs.get("attention_mask")
    if mask is not None and not (
        isinstance(mask, torch.Tensor) and mask.shape == ids.shape and bool((mask == 1).all())
    ):
        return "an attention_mask with padding (or shaped unlike input_ids)"
    kv_cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if kv_cache is not None and not (is_kv_cache(kv_cache) and kv_cache_capacity(kv_cache)):
        return "a KV cache that is not a StaticCache"
    settings = {k: v for k, v in kwargs.items() if k not in _ARGUMENTS}
    given = kwargs.get("generation_config")
    # what transformers' generate asks before it fills in its defaults: a max_length set
    # nowhere means 20 new tokens (5.x), not 20 in all (found by a client trial)
    default_length = (
        kwargs.get("max_length") is None
        and (given is None or getattr(given, "max_length", None) is None)
        and getattr(getattr(model, "generation_config", None), "max_length", None) is None
    )
    default_min = (
        kwargs.get("min_length") is None
        and (given is None or getattr(given, "min_length", None) is None)
        and getattr(getattr(model, "generation_config", None), "min_length", None) is None
    )
    try:
        config, rest = model._prepare_generation_config(given, **settings)  # type: ignore[operator]
        set_otherwise = _unsupported_settings(config)
        config = model._prepare_generated_length(  # type: ignore[operator]
            config, default_length, default_min, "input_ids", int(ids.shape[1]), ids
        )
    except (AttributeError, TypeError, ValueError) as exc:
        return f"transformers' generation settings could not be read ({type(exc).__name__})"
    if rest:  # not a generation setting: a logits processor, a streamer, a model input...
        return f"option {sorted(rest)[0]!r}"
    if set_otherwise:
        return f"generation setting {set_otherwise[0]}"
    if kv_cache is not None and config.cache_implementation is not None:
        return "both cache_implementation and a KV cache (transformers refuses them together)"
    if kv_cache is None and config.cache_implementation != "static":
        return "a KV cache that is not static (cache_implementation='static' runs on the loop)"
    new = None if config.max_length is None else int(config.max_length) - int(ids.shape[1])
    if not isinstance(new, int) or new < 1:
        return "max_new_tokens below 1"
    # the last new token is never fed back: prompt + new - 1 positions, as in eager
    if kv_cache is not None and int(kv_cache_capacity(kv_cache)) < int(ids.shape[1]) + new - 1:  # type: ignore[arg-type]
        return "a KV cache shorter than the prompt and the new tokens (less the last)"
    eos = config.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    pad = config.pad_token_id
    if pad is None and eos is not None:  # as transformers does (it warns)
        pad = eos[0] if isinstance(eos, list) else eos
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if mask is None and pad is not None and pad not in eos_ids and bool((ids == pad).any()):
        # transformers masks a prompt's pad tokens where no mask is passed (its
        # _prepare_attention_mask_for_generation): a padded batch
        return "input_ids holding the pad token (transformers masks it)"
    top_k = config.top_k if config.top_k else None
    top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    return LoopRequest(
        ids, new, bool(config.do_sample), temperature, top_k, top_p, eos,
        None if pad is None else int(pad), kv_cache,
    )  # fmt: skip


def holds_tokens(cache: Any) -> bool:
    """Whether a passed KV cache holds tokens (one read of its length: a device sync on
    a GPU, as the loop's own check of it makes)."""
    try:
        return int(cache.get_seq_length()) > 0
    except Exception:  # a cache that cannot say: the loop's own check decides
        return False


def _unsupported_settings(config: Any) -> list[str]:
    """The names of the effective ``config``'s settings the loop does not implement that
    differ from transformers' defaults (names only: ``served.stats`` counts reasons, and
    a reason holding values would make a server's count grow without bound)."""
    defaults = _defaults(type(config))  # type: ignore[arg-type]
    found = []
    for name, value in config.to_dict().items():
        if name in _SETTINGS or name in _IGNORED or name.startswith("_"):
            continue
        if value != defaults.get(name) and not (value in (None, False) and name not in defaults):
            found.append(name)
    return found


@functools.cache
def _defaults(config_type: type) -> Mapping[str, Any]:
    """transformers' defaults of every setting: a fresh config's, then its global ones
    (made once per config class, not per generate call)."""
    defaults = dict(config_type().to_dict())
    defaults.update(config_type._get_default_generation_params())  # type: ignore[attr-defined]
    return types.MappingProxyType(defaults)


class DecodeLoops:
    """The compiled loop models and KV caches of one ``serve_generate`` block.

    Free KV caches are kept for the next request of their key, at most ``kept_caches`` of
    them besides those ``prepare`` made (kept whatever the bound: a request of a prepared
    shape finds one, unless another request holds it); past the bound the least recently
    returned is dropped, and its memory with it (a step graph captured on it is keyed by
    its addresses and replays only on tensors at those addresses, shaped alike)."""

    def __init__(
        self, model: torch.nn.Module, dynamic_batch: bool, kept_caches: int = KEPT_CACHES
    ) -> None:
        self.model = model
        self.dynamic_batch = dynamic_batch
        self.kept_caches = kept_caches
        self.compiled: dict[tuple[Any, ...], Any] = {}
        # id(cache) -> (key, cache), least recently returned first
        self._free: OrderedDict[int, tuple[tuple[Any, ...], Any]] = OrderedDict()
        self._pinned: set[int] = set()  # ids of the caches prepare made
        self.dropped = 0  # caches dropped by the bound

    def key(self, request: LoopRequest) -> tuple[Any, ...]:
        """The compiled loop model's key: the batch only without ``dynamic_batch``."""
        ids = request.input_ids
        batch = None if self.dynamic_batch else int(ids.shape[0])
        return (batch, request.capacity, ids.dtype, str(ids.device))

    @staticmethod
    def cache_key(request: LoopRequest) -> tuple[Any, ...]:
        """A kept KV cache's key: a cache holds one sequence per row, whatever the
        compiled model serves."""
        ids = request.input_ids
        return (int(ids.shape[0]), request.capacity, ids.dtype, str(ids.device))

    def compile(
        self, key: tuple[Any, ...], request: LoopRequest, options: Mapping[str, Any]
    ) -> Any:
        """The loop model for ``key``: ``compile_model`` of a keyword call of
        ``input_ids`` (sequence dim dynamic; the batch too with ``dynamic_batch``) and a
        ``StaticCache`` of the request's capacity, with compile_model's ``options``."""
        from ._model import compile_model

        ids = request.input_ids
        batch = max(2, int(ids.shape[0])) if self.dynamic_batch else int(ids.shape[0])
        example = torch.zeros(batch, 2, dtype=ids.dtype, device=ids.device)
        call = {"input_ids": example, "past_key_values": self._new_cache(request.capacity),
                "use_cache": True}  # fmt: skip
        dynamic: dict[int | str, list[int]] = {"input_ids": [0, 1] if self.dynamic_batch else [1]}
        compiled = compile_model(self.model, (), call, dynamic=dynamic, **options)
        if ("input_ids", 1) in compiled.refused_at_one():
            # no decode step: OPT's, whose positions come from the mask's cumulative sum,
            # could not be traced at one token (a data-dependent length)
            raise UnsupportedGraphError(
                "the model could not be traced at one token (the decode step); "
                "compile_model logged why"
            )
        self.compiled[key] = compiled
        return compiled

    def take_cache(self, key: tuple[Any, ...], capacity: int) -> Any:
        """A kept cache for ``key`` no other request holds (the one returned last), else
        a new one."""
        for ident, (held, cache) in reversed(self._free.items()):
            if held == key:
                del self._free[ident]
                return cache
        return self._new_cache(capacity)

    def give_back(self, key: tuple[Any, ...], cache: Any, *, pin: bool = False) -> None:
        """Keep ``cache`` (``reset()``) for the next request of ``key``; ``pin``: one
        ``prepare`` made, kept whatever the bound."""
        cache.reset()
        if pin:
            self._pinned.add(id(cache))
        self._free[id(cache)] = (key, cache)
        unpinned = [ident for ident in self._free if ident not in self._pinned]
        for ident in unpinned[: max(0, len(unpinned) - self.kept_caches)]:
            dropped_key, _ = self._free.pop(ident)
            self.dropped += 1
            log.info("serve_generate: a kept KV cache (batch %s, length %s) dropped: more "
                     "than kept_caches=%d free", dropped_key[0], dropped_key[1],
                     self.kept_caches)  # fmt: skip

    def kept(self) -> int:
        """The free KV caches kept now."""
        return len(self._free)

    def _new_cache(self, capacity: int) -> Any:
        import transformers

        return transformers.StaticCache(config=self.model.config, max_cache_len=capacity)
