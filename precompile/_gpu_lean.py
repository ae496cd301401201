"""Completing a GPU variant's lean call: its Triton launches recorded, its run checked.

A GPU wrapper module creates its Triton kernels through inductor's autotuners, which pick
each kernel's config by benchmarking on its first run. The lean path launches kernels
from their binaries with no inductor in the process, so the launch inductor settled on
must be known at build time: the variant's module is imported here as inductor imports
it, run (twice: the first run autotunes) on inputs synthesized at the variant's point,
and each kernel's one remaining launcher recorded (``adapter.recorded_launch``). The
lean runner is then built from those records and run on the same inputs; it is kept
only if every output is bitwise equal to inductor's. Anything else leaves the variant on
upstream's path, with the reason logged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from precompile.runtime import LeanCall, Manifest, Variant
from precompile.runtime.compiler_interface import load_lean, synthesize_inputs

from . import _torch_adapter as adapter

log = logging.getLogger("precompile")


def _fresh(inputs: Sequence[Any]) -> list[Any]:
    """Copies with the same sizes and strides: each run may write or free its inputs."""
    copies = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            copy = torch.empty_strided(
                value.size(), value.stride(), dtype=value.dtype, device=value.device
            )
            copies.append(copy.copy_(value))
        else:
            copies.append(value)
    return copies


def same_bits(expected: Sequence[Any], actual: Sequence[Any]) -> bool:
    """Whether two runs' outputs are bitwise equal (NaNs included), value by value."""
    if len(expected) != len(actual):
        return False
    for a, b in zip(expected, actual, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if a != b:
                return False
            continue
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        bits_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(bits_a, bits_b):
            return False
    return True


@contextmanager
def _same_draws(devices: Sequence[int]) -> Iterator[Callable[[], None]]:
    """Generators forked from the caller's (left where they were after), and a function
    that sets them back to where they stood at the start: runs after each call of it
    draw alike."""
    with torch.random.fork_rng(devices=devices):
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(index) for index in devices]

        def replay() -> None:
            torch.set_rng_state(cpu)
            for index, state in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(state, index)

        yield replay


@dataclasses.dataclass(frozen=True)
class CompletedLean:
    lean: LeanCall
    binaries: Mapping[str, bytes]


def complete(
    manifest: Manifest,
    variant: Variant,
    lean: LeanCall,
    source: str,
    kernels: Sequence[str],
) -> CompletedLean | str:
    """``lean`` with the launches of ``kernels`` recorded by running ``variant``, or why
    it stays off the lean path."""
    point = tuple(variant.point[name] for name in manifest.symbol_names)
    # (synthesized inputs come from generators of their own); random ops in the graph
    # draw from generators forked from the caller's, the same draws in both runs compared
    with torch.no_grad(), _same_draws(manifest.cuda_indices) as replay:
        inputs = synthesize_inputs(manifest, point, None)
        module = adapter.load_generated_module(source)
        module.call(_fresh(inputs))  # autotunes each kernel down to one launcher
        replay()
        expected = list(module.call(_fresh(inputs)))
        records = [adapter.recorded_launch(module, name) for name in kernels]
        reasons = [r for r in records if isinstance(r, str)]
        if reasons:
            return "; ".join(reasons)
        launches = tuple(r.launch for r in records if not isinstance(r, str))
        binaries = {r.launch.binary: r.binary for r in records if not isinstance(r, str)}
        completed = dataclasses.replace(lean, triton=launches)
        payloads = {**binaries, lean.source: source.encode()}
        run = load_lean(completed, source, f"check_{variant.index}", payloads.__getitem__)
        replay()
        actual = run(*_fresh(inputs))
        torch.cuda.synchronize()
    if not same_bits(expected, actual):
        return "its lean run's outputs differ from inductor's run of the same launches"
    return CompletedLean(completed, binaries)
