"""Which fused attention kernels (SDPA backends) a variant is compiled with.

cuDNN's fused attention is the fastest kernel on an H100 for a decode step against a
static KV cache (query length 1, key length the cache's): 28 us per call at batch 1
against 63 us for memory-efficient attention (measured alone; the model-level effect is
in ``benchmarks/decode.py`` and docs/decode.md). But cuDNN builds
an execution plan on the host for every input shape it has not seen in the calling
thread: about 50 ms. A hint variant that serves many sequence lengths would pay that at
each length first seen after the warm-up; flash and memory-efficient attention need no
plan.

So the choice is per variant, by what its attention sees:

* exact-size variants: the caller's switches (one shape; cuDNN where torch picks it);
* hint variants whose every attention call has fixed query and key lengths in this
  variant (a decode step: only the batch varies): the caller's switches, cuDNN included;
* other hint variants (prefill: the lengths vary): cuDNN off, where another backend is on.

"Fixed in this variant" is read from the variant's own compile: a variant is compiled
with cuDNN allowed only where its lengths could be fixed (every symbol in them at 0 or 1,
which the trace specializes), and compiled again without it if its guards leave a length
free. ``PRECOMPILE_CUDNN_ATTENTION``: ``auto`` (default) as above; ``1`` cuDNN allowed in
every hint variant; ``0`` in none.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from precompile.cache import env_flag
from precompile.runtime import InvalidOptionError

CUDNN_ATTENTION_ENV = "PRECOMPILE_CUDNN_ATTENTION"
# In every cache key, with the mode: a build under another policy compiled other code.
POLICY = "attention 2: cuDNN in hint variants whose attention lengths are fixed"


def cudnn_mode() -> str:
    """``auto``, ``on`` or ``off``, from ``PRECOMPILE_CUDNN_ATTENTION`` (a switch as
    every ``PRECOMPILE_*`` switch is read, or ``auto``)."""
    if os.environ.get(CUDNN_ATTENTION_ENV, "").strip().lower() in ("", "auto"):
        return "auto"
    try:
        return "on" if env_flag(CUDNN_ATTENTION_ENV, default=False) else "off"
    except InvalidOptionError:
        raise InvalidOptionError(
            f"{CUDNN_ATTENTION_ENV} must be auto, 1/true/yes/on or 0/false/no/off, "
            f"got {os.environ[CUDNN_ATTENTION_ENV]!r}"
        ) from None


def key_factor(switches: Mapping[str, bool]) -> dict[str, object]:
    """What of the attention choice goes into cache keys: the caller's switches, the
    policy and its mode."""
    return {"switches": dict(switches), "policy": POLICY, "mode": cudnn_mode()}


def sdpa_backends(
    switches: Mapping[str, bool], *, dynamic: bool, lengths_fixed: bool
) -> dict[str, bool]:
    """The SDPA switches a variant is compiled with: the caller's ``switches``, with cuDNN
    off in a hint variant (``dynamic``) whose attention lengths are not fixed, unless the
    mode says otherwise or no other backend is on (then cuDNN stays: torch would refuse)."""
    settings = dict(switches)
    others = settings.get("flash") or settings.get("mem_efficient") or settings.get("math")
    mode = cudnn_mode()
    if dynamic and others and (mode == "off" or (mode == "auto" and not lengths_fixed)):
        settings["cudnn"] = False
    return settings


def sdpa_switches() -> dict[str, bool]:
    """The caller's scaled-dot-product-attention backend switches (``torch.backends.cuda``)."""
    backends = torch.backends.cuda
    return {
        "flash": backends.flash_sdp_enabled(),
        "mem_efficient": backends.mem_efficient_sdp_enabled(),
        "math": backends.math_sdp_enabled(),
        "cudnn": backends.cudnn_sdp_enabled(),
    }


@contextmanager
def attention_backends(settings: Mapping[str, bool]) -> Iterator[None]:
    """Set the SDPA backend switches (process-wide, as torch keeps them) for a compile:
    AOTAutograd picks the fused attention kernel while it traces, by these switches."""
    backends = torch.backends.cuda
    switches = {
        "flash": (backends.flash_sdp_enabled, backends.enable_flash_sdp),
        "mem_efficient": (backends.mem_efficient_sdp_enabled, backends.enable_mem_efficient_sdp),
        "math": (backends.math_sdp_enabled, backends.enable_math_sdp),
        "cudnn": (backends.cudnn_sdp_enabled, backends.enable_cudnn_sdp),
    }
    before = {name: read() for name, (read, _) in switches.items()}
    try:
        for name, value in settings.items():
            switches[name][1](value)
        yield
    finally:
        for name, value in before.items():
            switches[name][1](value)
