"""Why a row is slower than the oracle at one M: its kernels, side by side.

    python benchmarks/kernels.py --block mlp --sizes 64,512,4096

For each M: the static oracle compile, the one upstream dynamic compile, ours through
torch.compile as ``shapes.py`` runs it, and every one of our variants that admits M
(called directly: no Dynamo guards, no dispatch), each profiled over the same calls.
Per row: ``do_bench`` median, the GPU time its kernels sum to per call, the number of
kernels per call, the host time per call spent launching them (a call the GPU finishes
before the host launches the next kernel is launch-bound), and its longest kernels.
Same blocks, options and timing as ``shapes.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import shapes  # noqa: E402
import torch  # noqa: E402

from _common import rotating  # noqa: E402

CALLS = 20


def profile(fn: Callable[[], Any]) -> dict[str, Any]:
    """Kernels per call, their GPU time, and the host time spent launching them."""
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(CALLS):
            fn()
        host_s = time.perf_counter() - began
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(CALLS):
                fn()
            torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.time_range.elapsed_us() / CALLS
            count += 1
    top = sorted(kernels.items(), key=lambda item: -item[1])[:8]
    return {
        "host_us_per_call": host_s / CALLS * 1e6,
        "kernels_per_call": count / CALLS,
        "gpu_us_per_call": sum(kernels.values()),
        "top_kernels_us": {name[:90]: round(us, 2) for name, us in top},
    }


def timed(fn: Callable[[], Any]) -> float:
    import triton.testing

    with torch.no_grad():
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def pool_calls(fn: Callable[[torch.Tensor], Any], m: int) -> Callable[[], Any]:
    return rotating(fn, [(x,) for x in shapes.input_pool(m)[:8]])


def variant_calls(ours: tuple[Any, list[Any]], m: int) -> dict[str, Callable[[], Any]]:
    """Each of our variants that admits M, called directly (no dispatch)."""
    from precompile.runtime.compiler_interface import synthesize_inputs

    art, example_inputs = ours
    sets = [synthesize_inputs(art.manifest, (m,), example_inputs) for _ in range(4)]
    rows = {}
    for candidate in art.explain(*sets[0]).candidates:
        if candidate.admissible:
            call = art.variant_callable(candidate.variant)
            label = f"ours[{candidate.variant}] {candidate.kind} {dict(candidate.point)}"
            rows[label] = rotating(call, sets)
    return rows


def measure(fn: Callable[[], Any]) -> dict[str, Any]:
    return {"do_bench_ms": timed(fn), **profile(fn)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block", choices=sorted(shapes.BLOCKS), default="mlp")
    parser.add_argument("--sizes", default="64,512,4096")
    parser.add_argument("--out", help="result JSON (default: results/kernels-BLOCK.json)")
    args = parser.parse_args()
    from _common import environment, table, write_json

    sizes = [int(v) for v in args.sizes.split(",")]
    model = shapes.make_model(args.block)
    found: dict[int, dict[str, Any]] = {m: {} for m in sizes}
    dynamic = shapes.compiled_dynamic(model)
    for m in sizes:
        found[m]["dynamic"] = measure(pool_calls(dynamic, m))
    ours_fn, artifacts = shapes.compiled_ours(model)
    ours = next((a, i) for a, i in artifacts if a.symbols)
    for m in sizes:
        found[m]["ours (dispatched)"] = measure(pool_calls(ours_fn, m))
        for label, fn in variant_calls(ours, m).items():
            found[m][label] = measure(fn)
    for m in sizes:
        found[m]["oracle"] = measure(pool_calls(shapes.compiled_static(model, m), m))
    document: dict[str, Any] = {"block": args.block, "environment": environment(shapes.DEVICE)}
    for m in sizes:
        results = document[str(m)] = found[m]
        print(f"\n[{args.block}] M={m}")
        print(
            table(
                ["row", "do_bench ms", "GPU us/call", "kernels/call", "host us/call"],
                [
                    [
                        k,
                        v["do_bench_ms"],
                        v["gpu_us_per_call"],
                        v["kernels_per_call"],
                        v["host_us_per_call"],
                    ]
                    for k, v in results.items()
                ],
            )
        )
        for label, result in results.items():
            top = result["top_kernels_us"].items()
            print(f"  {label}: " + ", ".join(f"{name} {us}" for name, us in top))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
        print(f"wrote {args.out}")
    else:
        print(f"wrote {write_json(f'kernels-{args.block}.json', document)}")


if __name__ == "__main__":
    main()
