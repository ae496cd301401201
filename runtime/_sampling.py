"""How ``generate`` chooses each token and when a row stops: one frozen value, checked once
where it is made, passed whole from ``CompiledModel.generate`` to the decode loop and the
step-graph key (which takes its part from it).

Choosing follows transformers' ``generate``: greedy takes the argmax; sampling applies
the temperature, then top-k, then top-p, then draws with ``torch.multinomial``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ._errors import InvalidOptionError


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _eos_ids(eos_token_id: Any) -> tuple[int, ...]:
    """The stopping ids as ints (an int, a sequence of them, or an integer tensor, as
    transformers takes them), else ``InvalidOptionError`` naming the argument."""
    if isinstance(eos_token_id, torch.Tensor) and not eos_token_id.dtype.is_floating_point:
        ids: Any = eos_token_id.reshape(-1).tolist()
    elif eos_token_id is None:
        ids = []
    elif isinstance(eos_token_id, int):
        ids = [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple)):
        ids = list(eos_token_id)
    else:
        ids = [None]
    if any(not _is_int(v) or v < 0 for v in ids):
        raise InvalidOptionError(
            "eos_token_id must be a token id (an int >= 0), a list of them or an integer "
            f"tensor, got {eos_token_id!r}"
        )
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A generate's choice and stopping settings. Make it with ``Sampling.of`` (which
    takes ``eos_token_id`` in every form transformers does); both ways check every field."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # drawn from when sampling (else torch's default generator); its state is the caller's
    generator: torch.Generator | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None  # what a finished row is filled with

    @classmethod
    def of(
        cls,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | torch.Tensor | None = None,
        pad_token_id: int | None = None,
    ) -> Sampling:
        return cls(do_sample, temperature, top_k, top_p, generator, _eos_ids(eos_token_id),
                   pad_token_id)  # fmt: skip

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise InvalidOptionError(f"do_sample must be True or False, got {self.do_sample!r}")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise InvalidOptionError(f"temperature must be a number > 0, got {temperature!r}")
        if not temperature > 0:
            raise InvalidOptionError(f"temperature must be a number > 0, got {temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise InvalidOptionError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        top_p = self.top_p
        if top_p is not None and (
            isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
        ):
            raise InvalidOptionError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise InvalidOptionError(
                f"generator must be a torch.Generator or None, got {self.generator!r}"
            )
        _eos_ids(self.eos_token_id)
        pad = self.pad_token_id
        if self.eos_token_id and (pad is None or not _is_int(pad) or pad < 0):
            raise InvalidOptionError(
                "pad_token_id (a token id, an int >= 0) is needed with eos_token_id: rows "
                f"that finished are filled with it; got {pad!r}"
            )

    def check_device(self, device: torch.device) -> None:
        """Refuse a generator for another kind of device than the prompt's."""
        generator = self.generator
        if generator is not None and generator.device.type != device.type:
            raise InvalidOptionError(
                f"generator must be a torch.Generator on input_ids' device ({device}) or "
                f"None, got {generator!r} on {generator.device}"
            )

    @property
    def own_generator(self) -> bool:
        """Whether the draws come from a generator the caller gave (not torch's default)."""
        return self.do_sample and self.generator is not None

    @property
    def fill(self) -> int:
        return self.pad_token_id or 0

    def key(self) -> Hashable:
        """This part of a decode-step graph's key: what a captured step bakes in. Greedy
        steps read no sampling setting (left out), and of the generator only whether one
        is given counts (its state is copied in and out around the steps)."""
        if not self.do_sample:
            return (False, 1.0, None, None, False, self.eos_token_id, self.fill)
        return (True, self.temperature, self.top_k, self.top_p, self.own_generator,
                self.eos_token_id, self.fill)  # fmt: skip

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One token per row from the last position's logits, as transformers chooses it
        (``generator``: what a sampled step draws from, the given one or a stand-in)."""
        scores = logits[:, -1, :].to(dtype=torch.float32, copy=True)
        if not self.do_sample:
            return scores.argmax(dim=-1)
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k is not None:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]))[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
            remove[..., -1:] = False  # the likeliest token is always kept
            scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        probabilities = scores.softmax(dim=-1)
        return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)
