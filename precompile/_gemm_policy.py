"""Which GEMM kernels a variant is compiled with.

Inductor's default for a matmul is an extern call to cuBLAS. cuBLAS chooses its kernel on
the host for each (M, N, K) it has not seen: about 0.27 ms per GEMM on an H100. A hint
variant serves every size of its dynamic dims, so each size first seen after the warm-up
paid that once per GEMM: 12-17 ms for the README Llama's 30 GEMMs. Inductor's Triton GEMM
templates compile M symbolically and launch at any M alike: a new size costs 1-3 ms.
Steady state was no slower at any size measured (``benchmarks/gemm_backends.py``,
``results/gemm-backends-h100.json``). The build costs more: the templates are autotuned
at each hint.

So CUDA hint variants that serve more than one size use Triton GEMM templates, but two
kinds keep inductor's default (cuBLAS):

* exact-size variants: they serve one size, whose cuBLAS plan the warm-up makes. So does
  a hint variant whose point has every dynamic dim at 0 or 1, which the trace specializes
  (a decode step for one row): it serves one size too, and there the templates were
  slower, measured in one run on an H100 (``benchmarks/decode.py``'s Llama at batch 1:
  506 us of GPU time per step against 423 us with cuBLAS).
* hint variants compiled with cuDNN attention because their attention lengths are fixed
  there (a decode step on a static cache; see ``_attention_policy``): a batch size new
  to one already builds a cuDNN plan on the host, beside which cuBLAS's choice is small,
  and cuBLAS is faster per step. Both sides in one run on an H100
  (``benchmarks/results/decode-gemm-h100.json``, ``CompiledModel.generate`` with CUDA
  graphs, ms per token): 0.524 / 0.634 at batch 4 / 8 with cuBLAS against 0.548 / 0.658
  with the templates (the hand-captured ``torch.compile`` graph: 0.526 / 0.638); a new
  batch's first step 72-74 ms against 55-58 ms (the cuDNN plan is most of both). Where
  the compile's guards leave a length free after all, the variant is compiled again
  without cuDNN and keeps cuBLAS.

Those template variants do not time each GEMM with its fused epilogue against the GEMM
alone (inductor's ``benchmark_epilogue_fusion``): each such timing compiled the fused
kernel in the building thread, one at a time (18 in a 4-layer Llama build, about 10 s).
Measured on H200s (``benchmarks/build.py --steady``, the docs' Llama at 4 layers, five
pairs, each in one call): build median 75.3 s with the timings, 63.6 s without, every
pair faster; steady state at 8 to 2048 tokens within 6% cell by cell where the host was
quiet, neither side ahead throughout (``results/build-epilogue-h200.json``).

A caller who sets any of the GEMM autotuning options (in ``options["config_patches"]``
or in inductor's config) keeps their choice; so does one who sets the epilogue timing
(there, or through its environment variable). A variant whose GEMMs no template can serve
is compiled with the caller's options (see ``precompile._standalone``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Set
from typing import Any

# What the policy sets; and what, set by the caller, leaves their choice in place.
TRITON_GEMMS: Mapping[str, Any] = {
    "max_autotune_gemm": True,
    "max_autotune_gemm_backends": "TRITON",
}
CALLER_CHOICES = frozenset({"max_autotune", "max_autotune_gemm", "max_autotune_gemm_backends"})
# What the policy sets for those variants' epilogues, unless the caller chose (the config
# entry or the variable inductor reads it from).
EPILOGUES_UNTIMED: Mapping[str, Any] = {"benchmark_epilogue_fusion": False}
EPILOGUE_VARIABLE = "TORCHINDUCTOR_BENCHMARK_EPILOGUE_FUSION"
# In every cache key: a build under another policy compiled other code.
POLICY = (
    "gemm 4: CUDA hint variants that serve more than one size use Triton GEMM templates "
    "unless the caller chose or the variant is a decode step on cuDNN attention; their "
    "epilogue fusions are not timed unless the caller chose"
)


def gemm_options(
    options: Mapping[str, Any],
    *,
    device: str,
    dynamic: bool,
    caller_config: Set[str],
    cudnn_decode: bool = False,
) -> dict[str, Any] | None:
    """The compile options of a variant on ``device`` (``dynamic``: a hint variant that
    serves more than one size; ``cudnn_decode``: one compiled with cuDNN attention for
    its fixed attention lengths), where the policy changes them, else None.
    ``caller_config``: the inductor config entries the caller holds at other than their
    defaults."""
    if device != "cuda" or not dynamic or cudnn_decode:
        return None
    patches = options.get("config_patches") or {}
    if not isinstance(patches, Mapping):
        return None  # inductor names what is wrong with it
    if CALLER_CHOICES & set(patches) or CALLER_CHOICES & set(caller_config):
        return None
    chosen = {**patches, **TRITON_GEMMS}
    if not (set(EPILOGUES_UNTIMED) & (set(patches) | set(caller_config))
            or EPILOGUE_VARIABLE in os.environ):  # fmt: skip
        chosen.update(EPILOGUES_UNTIMED)
    return {**options, "config_patches": chosen}
