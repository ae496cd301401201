"""One process of the hostile-input fuzzer (``tests/fleet/test_hostile_fuzz.py``).

``python hostile_fuzz_child.py CACHE_DIR FIRST``: compiles (or loads from the cache) each
target once, then runs the seeded cases from number FIRST on, one JSON line each, flushed
before the next starts: a case that ends this process is the one after the last line.
Each case calls eager and the compiled model with the same inputs and reports whether
the outcomes agree: the same numbers, or the compiled model raised one of precompile's
errors (eager may answer: a refusal is clear, never a wrong number)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, "tests")
from tiny_models_helpers import VOCAB, tiny_llama

import precompile

SEED = 48
CASES = 64
ROWS = 32  # the positional table's rows (GPT-2's n_positions)


class Positions(torch.nn.Module):
    """Absolute positions (GPT-2, OPT, BART): arange(seq) indexes a table of ROWS."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(ROWS, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[torch.arange(x.shape[1])].unsqueeze(0)


class MaskRows(torch.nn.Module):
    """A mask indexed by arange(batch): its rows must be at least the batch (a Llama's
    padding mask built per batch row)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = mask[torch.arange(x.shape[0])]
        return x * rows[:, : x.shape[1]].unsqueeze(-1)


class Gather(torch.nn.Module):
    """Index values given by the caller, along a dynamic dim."""

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.gather(x, 1, index).relu() + torch.index_select(x, 1, index[0])[:1]


def _compile(cache: str) -> dict[str, tuple[torch.nn.Module, Any]]:
    torch.manual_seed(0)
    targets: dict[str, tuple[torch.nn.Module, Any]] = {}
    with torch.no_grad():
        model: torch.nn.Module = Positions()
        targets["positions"] = (
            model,
            precompile.compile_model(model, (torch.randn(4, 8, 64),), dynamic={0: [0, 1]},
                                     cache=cache, warmup=False),
        )  # fmt: skip
        model = MaskRows()
        example = (torch.randn(3, 8, 16), torch.ones(3, 12))
        targets["mask_rows"] = (
            model,
            precompile.compile_model(model, example, dynamic={0: [0, 1], 1: [0, 1]}, cache=cache,
                                     hints={(0, 0): [4], (0, 1): [8], (1, 0): [4], (1, 1): [12]},
                                     warmup=False),
        )  # fmt: skip
        model = Gather()
        example = (torch.randn(4, 10), torch.zeros(4, 6, dtype=torch.long))
        targets["gather"] = (
            model,
            precompile.compile_model(model, example, dynamic={0: [0, 1], 1: [0, 1]}, cache=cache,
                                     warmup=False),
        )  # fmt: skip
        model = tiny_llama()
        ids = torch.randint(0, VOCAB, (2, 7))
        kwargs = {"attention_mask": torch.ones(2, 7, dtype=torch.long),
                  "position_ids": torch.arange(7).repeat(2, 1), "use_cache": False}  # fmt: skip
        targets["llama"] = (
            model,
            precompile.compile_model(model, (ids,), kwargs, cache=cache, warmup=False,
                                     dynamic={0: [0, 1], "attention_mask": [0, 1],
                                              "position_ids": [0, 1]}),
        )  # fmt: skip
    return targets


def _values(rng: random.Random, shape: tuple[int, ...], high: int) -> torch.Tensor:
    """Ids of ``shape``: in [0, high), or with one hostile value."""
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    values = torch.randint(0, high, shape, generator=generator)
    kind = rng.choice(["good", "good", "above", "negative", "huge"])
    if kind != "good" and values.numel():
        flat = values.view(-1)
        flat[rng.randrange(flat.numel())] = {"above": high, "negative": -1, "huge": 2**62}[kind]
    return values


def case(number: int) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The target and inputs of case ``number`` (fixed by SEED)."""
    rng = random.Random(SEED * 100_003 + number)
    target = ["positions", "mask_rows", "gather", "llama"][number % 4]
    batch, seq = rng.randint(1, 5), rng.randint(1, 40)
    dtype = rng.choice([torch.float32] * 4 + [torch.float64])
    if target == "positions":
        return target, (torch.randn(batch, seq, 64, dtype=dtype),), {}
    if target == "mask_rows":
        rows = rng.choice([batch, batch, max(batch - 1, 1), batch + 1])
        width = rng.choice([seq, seq + 3, max(seq - 1, 1)])
        return target, (torch.randn(batch, seq, 16), torch.ones(rows, width)), {}
    if target == "gather":
        cols = rng.randint(1, 12)
        index = _values(rng, (batch, cols), seq)
        if rng.random() < 0.2:
            index = index.int()
        return target, (torch.randn(batch, seq), index), {}
    ids = _values(rng, (batch, seq), VOCAB)
    if rng.random() < 0.15:
        ids = ids.int()
    rows = rng.choice([batch, batch, batch, max(batch - 1, 1), batch + 1])
    length = rng.choice([seq, seq, max(seq - 1, 1), seq + 1])
    mask = torch.ones(rows, length, dtype=torch.long)
    if mask.shape[1] > 2 and rng.random() < 0.5:
        mask[0, :2] = 0  # left padding
    start = rng.choice([0, 0, 200, 300])  # past max_position_embeddings (256) too
    positions = torch.arange(start, start + seq).repeat(rows, 1)
    kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
    return target, (ids,), kwargs


def _outcome(call: Callable[..., Any], args: Any, kwargs: Any) -> tuple[str, Any]:
    try:
        out = call(*args, **kwargs)
    except Exception as exc:  # the outcome is what is compared
        return "raised", exc
    return "served", getattr(out, "logits", out)


def main() -> None:
    cache, first = sys.argv[1], int(sys.argv[2])
    targets = _compile(cache)
    print(json.dumps({"ready": True}), flush=True)
    for number in range(first, CASES):
        target, args, kwargs = case(number)
        model, compiled = targets[target]
        with torch.no_grad():
            eager, want = _outcome(model, args, kwargs)
            ours, got = _outcome(compiled, args, kwargs)
        if ours == "served":
            equal = eager == "served" and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
            verdict = "equal" if equal else "DIFFERENT" if eager == "served" else "EAGER RAISED"
            said = "" if eager == "served" else f"eager: {type(want).__name__}"
        else:
            clear = isinstance(got, precompile.PrecompileError)
            verdict = "clear error" if clear else "UNCLEAR ERROR"
            said = f"{type(got).__name__}: {str(got)[:160]}"
        print(json.dumps({"case": number, "target": target, "verdict": verdict,
                          "said": said}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
