"""``model.generate()`` under ``serve_generate``: the compiled loop against per forward.

    python benchmarks/generate_loop.py [--device cuda]

The tests' tiny Llama (2 layers, hidden 32, vocab 128; fp32), batch 1, a prompt of 8,
greedy with no EOS: transformers' own ``generate`` (eager), then, in the same process,
``serve_generate(hints=[8], cudagraphs=True, loop=True)`` and ``serve_generate(hints=[8],
cudagraphs=True)`` (every forward of transformers' loop on a compiled model). Per token:
(time of 65 new tokens - time of 1) / 64, median of 5, prefill excluded; the first
``generate`` of each block with its compiles; whether the tokens equal transformers'
own. A tiny model shows the host's time per step, which is what the loop removes; the
decode benchmark (``decode.py``) has the row on the docs' Llama. Writes
``results/generate-loop-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def per_token(run: Callable[[int], Any], sync: Callable[[], None]) -> float:
    """ms per new token: (65 new - 1 new) / 64, each the median of 5."""
    medians = {}
    for new in (1, 65):
        times = []
        for _ in range(5):
            sync()
            began = time.perf_counter()
            run(new)
            sync()
            times.append(time.perf_counter() - began)
        medians[new] = statistics.median(times)
    return round((medians[65] - medians[1]) / 64 * 1e3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="the result file (default: results/)")
    args = parser.parse_args()
    import torch
    from decode_helpers import VOCAB, build

    import precompile

    from _common import RESULTS, device_slug, environment

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    model = build("llama").to(args.device)
    torch.manual_seed(4)
    prompt = torch.randint(3, VOCAB, (1, 8), device=args.device)
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None,
                   cache_implementation="static")  # fmt: skip
    store = tempfile.mkdtemp(prefix="generate-loop-")
    rows: dict[str, Any] = {}
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=65, **options)
        ms = per_token(lambda n: model.generate(prompt, max_new_tokens=n, **options), sync)
        rows["transformers generate"] = {"ms_per_token": ms}
        for row, loop in (("serve_generate(loop=True)", True), ("serve_generate", False)):
            began = time.perf_counter()
            with precompile.serve_generate(model, hints=[8], cudagraphs=True, cache=store,
                                           loop=loop) as served:  # fmt: skip
                got = model.generate(prompt, max_new_tokens=65, **options)
                first = time.perf_counter() - began
                ms = per_token(lambda n: model.generate(prompt, max_new_tokens=n, **options), sync)
            rows[row] = {"ms_per_token": ms, "first_generate_s": round(first, 1),
                         "tokens_equal": bool(torch.equal(got, want)),
                         "stats": served.stats}  # fmt: skip
            print(row, rows[row], flush=True)
    env = environment(args.device)
    path = args.out or os.path.join(RESULTS, f"generate-loop-{device_slug(args.device, env)}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"environment": env, "rows": rows}, handle, indent=1)
        handle.write("\n")
    print("| row | ms/token | first generate s | tokens equal |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['ms_per_token']} | {row.get('first_generate_s', '-')} | "
              f"{row.get('tokens_equal', '-')} |")  # fmt: skip


if __name__ == "__main__":
    main()
