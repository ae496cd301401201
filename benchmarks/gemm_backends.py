"""Which GEMM backend the README Llama's variants should use: both sides of the trade-off in
one run (GPU only).

    python benchmarks/gemm_backends.py [--settings default,cublas,triton,aten+triton]

Settings: ``default`` (precompile's policy: hint variants on Triton GEMM templates, exact
sizes on cuBLAS), ``cublas`` (inductor's default everywhere), ``triton`` (templates
everywhere), ``aten+triton`` (inductor autotunes between the two at each variant's size).

For each setting, a fresh process compiles the Llama (``compile_model``, hints 16/256/2048,
bf16) into its own cache; a second fresh process loads it with ``compile=False``, waits for
the background warm-up, then measures

* ``steady_ms``: the median of 20 calls (CUDA events) at sizes the warm-up saw and did not;
* ``new_size_ms``: the first call at each of several sizes first seen after the warm-up
  (host clock around a synchronized call: what a request at a new length waits).

cuBLAS (inductor's default for these GEMMs) spends host time on every (M, N, K) it has not
seen; inductor's Triton GEMM templates compile M symbolically and launch at any M alike,
at a steady-state cost this script measures. Rows print as a table and go to
``results/gemm-backends-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

HINTS = [16, 256, 2048]
FIRST = 128
STEADY = [1, 16, 128, 256, 512, 1024, 2048]
NEW = [200, 201, 333, 700, 1500]
SETTINGS: dict[str, dict[str, Any] | None] = {
    "default": None,  # hint variants: Triton templates; exact sizes: cuBLAS
    "cublas": {"config_patches": {"max_autotune_gemm_backends": "ATEN"}},
    "triton": {
        "config_patches": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON"}
    },
    "aten+triton": {
        "config_patches": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
    },
}


def _child(phase: str, setting: str) -> dict[str, Any]:
    import torch

    import precompile

    from _common import llama

    model = llama("issue", "cuda", torch.bfloat16)
    vocab = model.config.vocab_size

    def ids(size: int) -> Any:
        return torch.randint(0, vocab, (1, size), device="cuda")

    result: dict[str, Any] = {}
    with torch.no_grad():
        began = time.perf_counter()
        compiled = precompile.compile_model(
            model, (ids(FIRST),), dynamic={0: [1]}, hints=HINTS, options=SETTINGS[setting],
            compile=phase == "build", warmup="background" if phase == "serve" else False,
        )  # fmt: skip
        compiled(ids(FIRST))
        torch.cuda.synchronize()
        if phase == "build":  # sizes as strings, as the JSON the parent reads has them
            return {"build_s": time.perf_counter() - began}
        compiled.wait_warm(timeout=600)
        for size in NEW:
            x = ids(size)
            torch.cuda.synchronize()
            began = time.perf_counter()
            compiled(x)
            torch.cuda.synchronize()
            result.setdefault("new_size_ms", {})[str(size)] = (time.perf_counter() - began) * 1e3
        for size in STEADY:
            x = ids(size)
            for _ in range(3):
                compiled(x)
            times = []
            for _ in range(20):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                compiled(x)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            result.setdefault("steady_ms", {})[str(size)] = sorted(times)[len(times) // 2]
        x = ids(333)  # against eager, bf16: the backend's rounding, not a wrong answer
        result["max_abs_diff_333_vs_eager"] = (
            (compiled(x).logits.float() - model(x).logits.float()).abs().max().item()
        )
    return result


def _run(phase: str, setting: str, cache: str) -> dict[str, Any]:
    environment = {
        **os.environ,
        "PRECOMPILE_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(),
        "TRITON_CACHE_DIR": tempfile.mkdtemp(),
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", phase, setting],
        env=environment, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return {"error": "\n".join(errors[-6:]) or done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(_child(*arguments.child)))
        return
    from _common import environment, median, table, write_json

    rows: dict[str, Any] = {}
    for setting in arguments.settings.split(","):
        cache = tempfile.mkdtemp()
        rows[setting] = {"options": SETTINGS[setting], **_run("build", setting, cache)}
        if "error" not in rows[setting]:
            rows[setting].update(_run("serve", setting, cache))
        print(setting, json.dumps(rows[setting])[:600], flush=True)
    headers = ["setting", "build s", "new size ms (median)", *[f"S={s} ms" for s in STEADY]]
    lines = []
    for setting, row in rows.items():
        if "steady_ms" not in row:
            lines.append([setting, "failed", "", *[""] * len(STEADY)])
            continue
        lines.append([setting, row["build_s"], median(list(row["new_size_ms"].values())),
                      *[row["steady_ms"][str(s)] for s in STEADY]])  # fmt: skip
    print(table(headers, lines))
    document = {**environment("cuda"), "hints": HINTS, "first": FIRST, "new_sizes": NEW,
                "rows": rows}  # fmt: skip
    name = document["device"]
    slug = "h200" if "H200" in name else "h100" if "H100" in name else "cuda"
    print(write_json(f"gemm-backends-{slug}.json", document))


if __name__ == "__main__":
    main()
