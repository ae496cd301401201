"""What a compile setting costs, on and off: the docs' Llama built under each, in a fresh
process with empty caches, then timed per call in that process (GPU).

    python benchmarks/settings.py --setting blocks [--layers 4] [--gemms cublas|templates]
    python benchmarks/settings.py --setting casts --gemms templates

``blocks``: its layers outlined (``PRECOMPILE_REPEATED_BLOCKS=1``) against compiled as
traced (the default). A piece's edge is a boundary inductor cannot fuse across (pieces
run from one layer's first matrix product to the next layer's, so the residual add and
the next norm stay together). ``casts``: fused kernels rounding where eager rounds (the
default, inductor's ``emulate_precision_casts``) against inductor's fused rounding
(``options={"config_patches": {"emulate_precision_casts": False}}``). Per setting:
the build's wall time, then the median ms per call (CUDA events, 3 interleaved rounds of
20 calls) at sequence lengths 1 (the decode trace), 8, 64 and 512, plain and with CUDA
graphs (``cudagraphs=True``). ``--gemms cublas`` builds with inductor's default GEMMs
(no autotuning, minutes less); ``templates`` with precompile's default policy. Then a decode loop
on a ``StaticCache`` (its own build, then ms per one-token step with CUDA graphs), and
the largest difference from eager's logits. Writes ``results/<setting>-<device>.json``.
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

# setting -> row -> (environment, config_patches) of its child process
SETTINGS: dict[str, dict[str, tuple[dict[str, str], dict[str, Any]]]] = {
    "blocks": {
        "blocks on": ({"PRECOMPILE_REPEATED_BLOCKS": "1"}, {}),
        "blocks off": ({"PRECOMPILE_REPEATED_BLOCKS": "0"}, {}),
    },
    "casts": {
        "casts emulated (default)": ({}, {}),
        "casts not emulated": ({}, {"emulate_precision_casts": False}),
    },
}
LENGTHS = [1, 8, 64, 512]
HINTS = [16, 256, 2048]


def child(layers: int, gemms: str, patches: dict[str, Any]) -> dict[str, Any]:
    import torch

    import precompile

    from _common import llama, median

    model = llama("issue", "cuda", torch.bfloat16, 4096, layers)
    vocab = model.config.vocab_size
    if gemms == "cublas":
        patches = {**patches, "max_autotune_gemm": False}
    options = {"config_patches": patches} if patches else None
    example = torch.randint(0, vocab, (1, 128), device="cuda")
    started = time.perf_counter()
    with torch.no_grad():
        plain = precompile.compile_model(
            model, (example,), {"use_cache": False}, dynamic={0: [1]}, hints=HINTS,
            options=options, warmup=False,
        )  # fmt: skip
        plain(example, use_cache=False)
        torch.cuda.synchronize()
        build = time.perf_counter() - started
        graphed = precompile.compile_model(
            model, (example,), {"use_cache": False}, dynamic={0: [1]}, hints=HINTS,
            options=options, warmup=False, cudagraphs=True, compile=False,
        )  # fmt: skip
        inputs = {n: torch.randint(0, vocab, (1, n), device="cuda") for n in LENGTHS}
        worst = max(
            float((plain(x, use_cache=False).logits - model(x, use_cache=False).logits)
                  .abs().max())
            for x in inputs.values()
        )  # fmt: skip
        timings: dict[str, dict[int, list[float]]] = {"plain": {}, "cudagraphs": {}}
        for _ in range(3):  # interleaved rounds
            for name, compiled in (("plain", plain), ("cudagraphs", graphed)):
                for n, x in inputs.items():
                    for _ in range(3):
                        compiled(x, use_cache=False)  # warm (and capture)
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    for _ in range(20):
                        compiled(x, use_cache=False)
                    end.record()
                    torch.cuda.synchronize()
                    timings[name].setdefault(n, []).append(start.elapsed_time(end) / 20)
        decode = _decode_ms(model, options)
    return {
        "decode": decode,
        "build_s": build,
        "max_abs_diff_vs_eager": worst,
        "ms": {k: {str(n): median(v) for n, v in by.items()} for k, by in timings.items()},
    }


def _decode_ms(model: Any, options: Any) -> dict[str, Any]:
    """A decode loop on a StaticCache: compile_model's build of the cache call, then the
    median ms per one-token step with CUDA graphs (3 rounds of 32 steps, each round on
    the same cache after ``reset()``, so the graphs replay)."""
    import torch
    from transformers import StaticCache

    import precompile

    from _common import median

    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=256)
    call = {"input_ids": torch.randint(0, vocab, (1, 16), device="cuda"),
            "past_key_values": cache, "use_cache": True}  # fmt: skip
    started = time.perf_counter()
    compiled = precompile.compile_model(
        model, (), call, dynamic={"input_ids": [1]}, hints={("input_ids", 1): [16]},
        options=options, warmup=False, cudagraphs=True,
    )  # fmt: skip
    build = time.perf_counter() - started
    prompt = torch.randint(0, vocab, (1, 16), device="cuda")
    steps: list[float] = []
    tokens: list[list[int]] = []
    for _ in range(3):
        cache.reset()
        out = compiled(input_ids=prompt, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        produced = []
        for _ in range(4):  # warm (and capture)
            out = compiled(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            produced.append(int(token))
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(32):
            out = compiled(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        end.record()
        torch.cuda.synchronize()
        steps.append(start.elapsed_time(end) / 32)
        tokens.append(produced)
    cache.reset()
    eager = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    token = eager.logits[:, -1:].argmax(-1)
    expected = []
    for _ in range(4):
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:]
        token = token.argmax(-1)
        expected.append(int(token))
    return {"build_s": build, "step_ms": median(steps), "tokens_equal_eager": tokens[0] == expected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="blocks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gemms", choices=["cublas", "templates"], default="cublas")
    parser.add_argument("--out", help="the result file (default: benchmarks/results/)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the row's config_patches
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.layers, args.gemms, json.loads(args.child))))
        return
    from _common import RESULTS, device_slug, environment, table

    env = environment("cuda")
    slug = device_slug("cuda", env)
    path = args.out or os.path.join(RESULTS, f"{args.setting}-{slug}.json")
    rows: dict[str, Any] = {}
    for setting, (variables, patches) in SETTINGS[args.setting].items():
        scratch = tempfile.mkdtemp(prefix="settings-bench-")
        child_env = {
            **os.environ,
            **variables,
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(scratch, "triton"),
            "PRECOMPILE_CACHE_DIR": os.path.join(scratch, "precompile"),
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        }
        command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(patches),
                   "--layers", str(args.layers), "--gemms", args.gemms]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, env=child_env)
        if out.returncode != 0:
            rows[setting] = {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
        else:
            rows[setting] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"[{args.setting}] {setting}: {rows[setting]}", flush=True)
    document = {"environment": env, "setting": args.setting, "layers": args.layers,
                "gemms": args.gemms, "rows": rows}  # fmt: skip
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    headers = ["setting", "build s", *(f"{m} S={n}" for m in ("plain", "graphs") for n in LENGTHS),
               "decode build s", "decode step ms", "max diff vs eager"]  # fmt: skip
    body = []
    for setting, r in rows.items():
        if "error" in r:
            body.append([setting, r["error"][:60], *["-"] * (len(headers) - 2)])
            continue
        cells = [r["ms"][m][str(n)] for m in ("plain", "cudagraphs") for n in LENGTHS]
        decode = r["decode"]
        body.append([setting, r["build_s"], *cells, decode["build_s"], decode["step_ms"],
                     r["max_abs_diff_vs_eager"]])  # fmt: skip
    print(table(headers, body))


if __name__ == "__main__":
    main()
