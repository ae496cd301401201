"""What the build costs: a transformers Llama compiled from nothing to its first output.

    python benchmarks/build.py                        # CPU: the tiny Llama at 2, 4, 8 layers
    python benchmarks/build.py --device cuda          # GPU: the docs' Llama at 4, 2, 8, 16 layers
    python benchmarks/build.py --device cuda --layers 4 --rows 'compile_model;torch.compile'

Every row runs in a fresh process with empty inductor, Triton and precompile caches, and
reports the wall time from the compile call to the first output (the first call's output
included), the CPU seconds of the process and of the processes it started over that time
(inductor's compile workers are shut down first, so theirs count), the inductor compiles
(``compile_fx`` calls) and the compiler processes (gcc, ptxas, ...) the process started.

Rows: ``torch.compile`` (default: the first call compiles for its sizes),
``torch.compile dynamic`` (``dynamic=True``), ``aot_compile`` (upstream's
``torch.compile(...).aot_compile`` with ``skip_all_guards_unsafe``, the filter it works
with on this model), ``compile_model`` (the docs' call: sequence dim dynamic, hints
16/256/2048), ``compile_model + cudagraphs`` (GPU). ``--before PATH`` adds
``compile_model before``: the same call on the source tree at PATH (a checkout's
``precompile``, ``runtime`` and ``cache`` folders), for a change's before and after in one
run. ``compile_model, blocks on``: with ``PRECOMPILE_REPEATED_BLOCKS=1`` (repeated
layers compiled once);
``compile_model, cuBLAS GEMMs``: with ``options={"config_patches": {"max_autotune_gemm":
False}}`` (inductor's default GEMMs, no autotuning); ``compile_model, variants in
workers`` and ``compile_model, variants in one process``: ``PRECOMPILE_COMPILE_WORKERS``
4 and 0 (the default row has the library's choice); ``compile_model, lengths from 2``: the
sequence declared from 2 (``dynamic={0: {1: (2, None)}}``), so no trace at length 1.
``compile_model, rebuilt in a shared build dir`` (and its ``before``): the docs' call
built once, unmeasured, then built again in a fresh process with an empty precompile
cache and the first process's ``$PRECOMPILE_BUILD_DIR``.
``--logs DIR`` keeps each row's log.

``--steady``: after its first output each row's process also times what a build trades
against: the first call at sizes it has not run (``new_size_ms``: 100, 300 and 1000 tokens,
after the steady calls, so each is a size new to a warmed-up model; a ``torch.compile``
row may recompile there) and the median of 20 calls at 8, 64, 512 and 2048 tokens
(``steady_ms``), each size warmed by one call first. So a change to the compile path
shows its build time, new-size cost and steady state from one run.

Results merge into ``benchmarks/results/build-<device>.json`` (``rows`` -> row -> layers),
so runs of other depths or rows add to one table; the plot is build time against depth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

ROWS = [
    "torch.compile",
    "torch.compile dynamic",
    "aot_compile",
    "compile_model",
    "compile_model + cudagraphs",
    "compile_model, blocks on",
    "compile_model, cuBLAS GEMMs",
    "compile_model before",
    "compile_model, variants in workers",
    "compile_model, variants in one process",
    "compile_model, lengths from 2",
    "compile_model, rebuilt in a shared build dir",
    "compile_model before, rebuilt in a shared build dir",
]
# A build again in a process sharing the first one's $PRECOMPILE_BUILD_DIR, its precompile
# cache empty: what a rebuild finds of the first build (a model file edited, a cache
# evicted, a builder running one build after another).
REBUILT = " rebuilt in a shared build dir"
DEFAULT_ROWS = ROWS[:5]
GPU_ONLY = ("compile_model + cudagraphs",)
HINTS = [16, 256, 2048]  # the docs' hints (docs/whole-models.md)
FIRST = 128
CPU_LAYERS = [2, 4, 8]
GPU_LAYERS = [4, 2, 8, 16]
STEADY_SIZES = [8, 64, 512, 2048]
NEW_SIZES = [100, 300, 1000]
STEADY_CALLS = 20


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _after_build(call: Any, vocab: int, device: str, sync: Any) -> dict[str, Any]:
    """The steady state and new-size cost of a built ``call`` (token ids -> logits)."""
    import statistics

    import torch

    def once(size: int) -> float:
        ids = torch.randint(0, vocab, (1, size), device=device)
        sync()
        started = time.perf_counter()
        call(ids)
        sync()
        return (time.perf_counter() - started) * 1e3

    steady: dict[str, float] = {}
    for size in STEADY_SIZES:
        once(size)
        steady[str(size)] = statistics.median(once(size) for _ in range(STEADY_CALLS))
    new = {str(size): once(size) for size in NEW_SIZES}
    return {"steady_ms": steady, "new_size_ms": new}


def child(row: str, layers: int, device: str, steady: bool = False) -> dict[str, Any]:
    from _common import count_tracing_and_compiles, is_compiler, llama, watch_processes

    spawned = watch_processes()
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("precompile").setLevel(logging.INFO)
    if row.startswith("compile_model"):
        import precompile
    frames, compiles = count_tracing_and_compiles()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = llama("tiny" if device == "cpu" else "issue", device, dtype, 4096, layers)
    ids = torch.randint(0, model.config.vocab_size, (1, FIRST), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    with torch.no_grad():
        if row.startswith("compile_model"):
            options = ({"config_patches": {"max_autotune_gemm": False}}
                       if row == "compile_model, cuBLAS GEMMs" else None)  # fmt: skip
            # the sequence from 2 (a declared range): no trace at length 1
            lengths = {1: (2, None)} if row == "compile_model, lengths from 2" else [1]
            compiled = precompile.compile_model(
                model, (ids,), {"use_cache": False}, dynamic={0: lengths}, hints=HINTS,
                cudagraphs=True if row == "compile_model + cudagraphs" else None,
                options=options,
            )  # fmt: skip

            def run(x: Any) -> Any:
                return compiled(x, use_cache=False).logits

            out = run(ids)
        elif row == "aot_compile":
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.config.enable_aot_compile = True

            def call(x: Any) -> Any:
                return model(x, use_cache=False).logits

            aot = torch.compile(
                call, fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
            ).aot_compile(((ids,), {}))  # fmt: skip

            def run(x: Any) -> Any:
                return aot(x)

            out = run(ids)
        else:
            fn = torch.compile(model, dynamic=True if row == "torch.compile dynamic" else None)

            def run(x: Any) -> Any:
                return fn(x, use_cache=False).logits

            out = run(ids)
        sync()
        first_output = time.perf_counter() - started
        expected = model(ids, use_cache=False).logits
        after = _after_build(run, model.config.vocab_size, device, sync) if steady else {}
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()  # its workers' CPU time counts once they are reaped
    cpu = _cpu_seconds() - cpu_before
    return {
        "first_output_s": first_output,
        "cpu_s": cpu,
        "inductor_compiles": len(compiles),
        "dynamo_frames": len(frames),
        "compiler_processes": sum(1 for p in spawned if is_compiler(p)),
        "max_abs_diff": float((out.float() - expected.float()).abs().max()),
        **after,
    }


def run_row(
    row: str,
    layers: int,
    device: str,
    before: str | None,
    logs: str | None = None,
    extra_env: dict[str, str] | None = None,
    steady: bool = False,
) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="build-bench-")
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(scratch, "triton"),
        "PRECOMPILE_CACHE_DIR": os.path.join(scratch, "precompile"),
    }
    source = before if row.startswith("compile_model before") else ROOT
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    measured = row
    if row.endswith(REBUILT):
        os.mkdir(os.path.join(scratch, "build"), mode=0o700)
        env["PRECOMPILE_BUILD_DIR"] = os.path.join(scratch, "build")
        measured = row.removesuffix("," + REBUILT)
    if row == "compile_model, blocks on":
        env["PRECOMPILE_REPEATED_BLOCKS"] = "1"
    env.update(extra_env or {})
    if row == "compile_model, variants in workers":  # four, or one per variant after the first
        env["PRECOMPILE_COMPILE_WORKERS"] = "4"
    if row == "compile_model, variants in one process":
        env["PRECOMPILE_COMPILE_WORKERS"] = "0"
    command = [sys.executable, os.path.abspath(__file__), "--child", measured,
               "--layers", str(layers), "--device", device,
               *(["--steady"] if steady else [])]  # fmt: skip
    try:
        if measured != row:  # the first build, into the shared build dir
            first = subprocess.run(command, capture_output=True, text=True, env=env,
                                   cwd=scratch, timeout=1800)  # fmt: skip
            if first.returncode != 0:
                return {"error": (first.stderr.strip().splitlines() or ["?"])[-1][:300]}
            shutil.rmtree(env["PRECOMPILE_CACHE_DIR"], ignore_errors=True)
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=scratch,
                             timeout=1800)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if logs:
        os.makedirs(logs, exist_ok=True)
        tags = "-".join(f"{k}-{v}" for k, v in (extra_env or {}).items())
        slug = re.sub(r"[^a-z0-9]+", "-", f"{row} {tags}".lower()).strip("-")[:80]
        with open(os.path.join(logs, f"{slug}-{layers}.log"), "w", encoding="utf-8") as handle:
            handle.write(out.stderr)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def report(document: dict[str, Any]) -> str:
    from _common import table

    layers = sorted({int(n) for by in document["rows"].values() for n in by})
    headers = ["row", *(f"{n} layers: first output s (cpu s, compiles, compilers)" for n in layers)]
    rows = []
    for row, by in document["rows"].items():
        cells: list[Any] = [row]
        for n in layers:
            r = by.get(str(n))
            if r is None:
                cells.append("-")
            elif "error" in r:
                cells.append(f"fails: {r['error'][:60]}")
            else:
                cells.append(f"{r['first_output_s']:.1f} ({r['cpu_s']:.0f}, "
                             f"{r['inductor_compiles']}, {r['compiler_processes']})")  # fmt: skip
        rows.append(cells)
    text = table(headers, rows)
    timed = [(row, n, by[str(n)]) for row, by in document["rows"].items() for n in layers
             if "steady_ms" in by.get(str(n), {})]  # fmt: skip
    if timed:
        steady = list(timed[0][2]["steady_ms"])
        new = list(timed[0][2]["new_size_ms"])
        text += "\n\n" + table(
            ["row", "layers", *(f"S={s} ms" for s in steady), *(f"new {s} ms" for s in new)],
            [[row, n, *(f"{r['steady_ms'][s]:.3f}" for s in steady),
              *(f"{r['new_size_ms'][s]:.1f}" for s in new)] for row, n, r in timed],
        )  # fmt: skip
    base = document["rows"].get("torch.compile", {})
    ours = document["rows"].get("compile_model", {})
    ratios = [
        f"{n} layers {ours[str(n)]['first_output_s'] / base[str(n)]['first_output_s']:.2f}x"
        for n in layers
        if "first_output_s" in ours.get(str(n), {}) and "first_output_s" in base.get(str(n), {})
    ]
    if ratios:
        text += "\n\ncompile_model / torch.compile, first output: " + ", ".join(ratios)
    flat = [n for n in layers if "first_output_s" in ours.get(str(n), {})]
    if len(flat) >= 2 and 4 in flat:
        deepest = max(flat)
        ratio = ours[str(deepest)]["first_output_s"] / ours["4"]["first_output_s"]
        text += f"\ncompile_model at {deepest} layers / at 4 layers: {ratio:.2f}x"
    return text


def plot(document: dict[str, Any], path: str) -> None:
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for row, by in document["rows"].items():
        points = sorted((int(n), r["first_output_s"]) for n, r in by.items()
                        if "first_output_s" in r)  # fmt: skip
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=row)
    axis.set_xlabel("decoder layers")
    axis.set_ylabel("build to first output, s")
    axis.set_ylim(bottom=0)
    axis.set_title(f"Llama build, cold caches: {document['environment']['device']}", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def _write(path: str, document: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", help="comma-separated depths (default: the device's)")
    parser.add_argument("--rows", help=f"rows of {ROWS}, separated by ';'")
    parser.add_argument("--out", help="the result file (default: benchmarks/results/)")
    parser.add_argument("--before", help="a source tree whose compile_model is 'before'")
    parser.add_argument("--logs", help="a folder for each row's log (stderr)")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE",
        help="set in every row's process; the rows are recorded as 'row [NAME=VALUE]'",
    )  # fmt: skip
    parser.add_argument(
        "--steady", action="store_true",
        help="also time each row's steady state and new-size cost after its first output",
    )  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, int(args.layers), args.device, args.steady)))
        return
    from _common import RESULTS, device_slug, environment

    layers = ([int(n) for n in args.layers.split(",")] if args.layers
              else CPU_LAYERS if args.device == "cpu" else GPU_LAYERS)  # fmt: skip
    rows = [r.strip() for r in args.rows.split(";")] if args.rows else list(DEFAULT_ROWS)
    if args.before:
        rows.append("compile_model before")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; the rows are {ROWS}")
    if args.device == "cpu":
        rows = [r for r in rows if r not in GPU_ONLY]
    env = environment(args.device)
    name = f"build-{device_slug(args.device, env)}.json"
    path = args.out or os.path.join(RESULTS, name)
    document: dict[str, Any] = {"environment": env, "rows": {}}
    if os.path.exists(path):  # runs of other depths or rows add to the same table
        with open(path, encoding="utf-8") as handle:
            earlier = json.load(handle)
        if earlier.get("environment", {}).get("device") == env["device"]:
            document["rows"] = earlier.get("rows", {})
    document["environment"] = env
    extra = dict(item.split("=", 1) for item in args.env)
    suffix = f" [{', '.join(args.env)}]" if args.env else ""
    for n in layers:  # by depth, rows side by side
        for row in rows:
            result = run_row(row, n, args.device, args.before, args.logs, extra, args.steady)
            document["rows"].setdefault(row + suffix, {})[str(n)] = result
            print(f"[build] {row} at {n} layers: {result}", flush=True)
            _write(path, document)
    print(report(document))
    plot(document, path.replace(".json", ".png"))


if __name__ == "__main__":
    main()
