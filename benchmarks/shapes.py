"""Per-token-count speed on the GPU: eager, one upstream dynamic compile, ours, the oracle.

    python benchmarks/shapes.py --block mlp --out benchmarks/results/shapes-mlp.json
    python benchmarks/shapes.py --block attention --out ... --resume   # continue a file
    python benchmarks/shapes.py --plot benchmarks/results/shapes-mlp.json

Blocks (bf16): ``mlp`` is RMSNorm(4096) -> Linear(4096, 2*11008) -> SiLU*mul ->
Linear(11008, 4096) + residual over M tokens; ``attention`` is RMSNorm -> QKV projection
-> causal SDPA (32 heads of 128) -> output projection + residual over a sequence of M
tokens. Rows: ``eager``; ``dynamic``: one ``torch.compile`` with max_autotune, first
called at M=256 with the token dim marked dynamic (Dynamo still compiles M=1 apart, as
a static graph: its 0/1 specialization; the same holds for ours); ``ours``:
``precompile.backend`` with hints 16, 256, 4096 plus exact sizes 1, 2, 4, 8;
``calibrated``: the same variants (loaded from ours' cache), calibrated over the sweep;
``oracle``: a static max_autotune compile per M. Every compiled row runs with the same
inductor options and no CUDA graphs, and each has its own Dynamo cache, so all stay
live at once. At each M the rows are measured side by side: 5 interleaved rounds of one
``triton.testing.do_bench`` median each (L2 flushed between runs, inputs rotated through
a pool of at least 256 MB), and the median round counts, so drift in clocks or
temperature moves every row alike. Each M is written as soon as it is measured, so
``--resume`` continues an interrupted run (``--deadline-s`` stops cleanly before a
machine's time limit; a resumed run compiles its rows again, and records its run number
with each result).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from _shapes_report import ROWS, plot, summarize  # noqa: E402

POWERS = [2**k for k in range(14)]  # 1 .. 8192
BETWEEN = [3, 100, 1000, 3000, 6000]
SWEEP = sorted(POWERS + BETWEEN)
HINTS = [16, 256, 4096]
EXACT = [1, 2, 4, 8]
DYNAMIC_FIRST_M = 256
ROUNDS = 5  # an H200 ran 2x slow for ~2 s once: 2 spoiled rounds of 3 at one M
OPTIONS = {"max_autotune": True, "triton.cudagraphs": False}
HIDDEN, FFN, HEADS = 4096, 11008, 32
DEVICE, DTYPE = "cuda", torch.bfloat16


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype) * self.weight


class MLPBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(HIDDEN)
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class AttentionBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).view(tokens, 3, HEADS, HIDDEN // HEADS).unbind(1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(0, 1).reshape(tokens, HIDDEN))


BLOCKS: dict[str, Callable[[], torch.nn.Module]] = {"mlp": MLPBlock, "attention": AttentionBlock}


def make_model(block: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = BLOCKS[block]().to(DEVICE, DTYPE).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    return model


def input_pool(m: int) -> list[torch.Tensor]:
    """Distinct inputs whose total exceeds L2 many times, so no call reads a warm copy."""
    each = m * HIDDEN * 2
    count = max(2, min(32, math.ceil(256 * 2**20 / each)))
    generator = torch.Generator(device=DEVICE).manual_seed(m)
    return [
        torch.randn(m, HIDDEN, device=DEVICE, dtype=DTYPE, generator=generator)
        for _ in range(count)
    ]


def bench(fn: Callable[[torch.Tensor], Any], m: int) -> float:
    """Median ms of ``fn`` at M tokens (device timing, L2 flushed, inputs rotated)."""
    from _common import rotating

    call = rotating(fn, [(x,) for x in input_pool(m)])
    with torch.no_grad():
        call()  # a first call may compile (Dynamo's M=1 graph): never timed
        if DEVICE == "cpu":  # --smoke: checks the script, measures nothing of note
            began = time.perf_counter()
            for _ in range(5):
                call()
            return (time.perf_counter() - began) / 5 * 1e3
        import triton.testing

        return float(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))


def max_error(fn: Callable[[torch.Tensor], Any], model: torch.nn.Module, m: int) -> float:
    x = input_pool(m)[0]
    with torch.no_grad():
        got, want = fn(x), model(x)
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


# -- rows ----------------------------------------------------------------------------
def entry_point(model: torch.nn.Module, tag: str) -> Callable[[torch.Tensor], Any]:
    """``model(x)`` as a function with its own code object: Dynamo keeps one cache per
    code object, so every compiled row stays live side by side, with no reset between."""

    def call(x: torch.Tensor) -> Any:
        return model(x)

    code = call.__code__.replace(co_name=f"row_{tag}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def first_call(fn: Callable[[torch.Tensor], Any], m: int, dynamic: bool) -> None:
    first = torch.randn(m, HIDDEN, device=DEVICE, dtype=DTYPE)
    if dynamic:
        torch._dynamo.mark_dynamic(first, 0)
    with torch.no_grad():
        fn(first)


def compiled_dynamic(model: torch.nn.Module) -> Callable[[torch.Tensor], Any]:
    compiled = torch.compile(entry_point(model, "dynamic"), options=OPTIONS)
    first_call(compiled, DYNAMIC_FIRST_M, dynamic=True)
    return compiled


def compiled_ours(
    model: torch.nn.Module, tag: str = "ours", cache: Any = False
) -> tuple[Callable[[torch.Tensor], Any], list[Any]]:
    """Ours through torch.compile, and the (artifact, example inputs) of each graph."""
    import precompile

    backend = precompile.backend(
        hints=HINTS, sizes=EXACT, options={"config_patches": OPTIONS}, cache=cache
    )
    artifacts: list[Any] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        artifact = backend(gm, example_inputs)
        artifacts.append((artifact, list(example_inputs)))
        return artifact

    compiled = torch.compile(entry_point(model, tag), backend=recording)
    first_call(compiled, DYNAMIC_FIRST_M, dynamic=True)
    return compiled, artifacts


def calibrate(artifacts: list[Any], sweep: list[int]) -> dict[str, Any]:
    """Calibrate ours in place over the sweep; the table, for the result file."""
    for artifact, example_inputs in artifacts:
        if artifact.symbols:
            table = artifact.calibrate(sweep, inputs=example_inputs)
            print(f"  calibrated {len(artifact.variants)} variants at {len(sweep)} sizes")
            labels = {v.index: f"{v.kind} {dict(v.point)}" for v in artifact.variants}
            return {
                str(entry.point[0]): {labels[i]: t * 1e3 for i, t in entry.times.items()}
                for entry in table.entries
            }
    return {}


def compiled_static(model: torch.nn.Module, m: int) -> Callable[[torch.Tensor], Any]:
    compiled = torch.compile(entry_point(model, f"oracle_{m}"), dynamic=False, options=OPTIONS)
    first_call(compiled, m, dynamic=False)
    return compiled


# -- driver --------------------------------------------------------------------------
class Results:
    """The result file: rows x M, rewritten atomically after every M."""

    def __init__(self, path: str, block: str, resume: bool) -> None:
        from _common import environment

        self.path = path
        self.document: dict[str, Any] = {}
        if resume and os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                self.document = json.load(handle)
        self.document.setdefault("block", block)
        self.document.setdefault("environment", environment(DEVICE))
        self.document.setdefault("rows", {})
        self.document.setdefault("compile_s", {})
        self.document["runs"] = self.document.get("runs", 0) + 1

    def done(self, rows: list[str], m: int) -> bool:
        return all(str(m) in self.document["rows"].get(row, {}) for row in rows)

    def add(self, row: str, m: int, result: dict[str, Any]) -> None:
        result["run"] = self.document["runs"]
        self.document["rows"].setdefault(row, {})[str(m)] = result
        if "ms" in result:
            print(f"  {row:10s} M={m:<5d} {result['ms']:.4f} ms  rel err {result['rel_error']:.1e}")
        else:
            print(f"  {row:10s} M={m:<5d} {result['error'].splitlines()[0]}")

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(self.document, handle, indent=1)
        os.replace(tmp, self.path)


def measure_side_by_side(
    fns: dict[str, Callable[[torch.Tensor], Any]], model: torch.nn.Module, m: int
) -> dict[str, dict[str, Any]]:
    """Every row at M, ROUNDS rounds of one ``bench`` each, rows interleaved (a drifting
    clock or temperature shifts all rows alike); the median round counts."""
    results: dict[str, dict[str, Any]] = {}
    live = {}
    for row, fn in fns.items():
        try:
            results[row] = {"rel_error": max_error(fn, model, m), "rounds": []}
            live[row] = fn
        except Exception as exc:  # ours refuses sizes no variant admits: record why
            if type(exc).__name__ != "NoVariantError":
                raise
            results[row] = {"error": str(exc)}
    for round_index in range(ROUNDS):
        order = list(live)
        order = order[round_index % len(order) :] + order[: round_index % len(order)]
        for row in order:
            results[row]["rounds"].append(bench(live[row], m))
    for row in live:
        results[row]["ms"] = statistics.median(results[row]["rounds"])
    return results


def run(
    block: str,
    rows: list[str],
    sweep: list[int],
    results: Results,
    deadline: float,
    cache: str | None = None,
) -> None:
    """``cache``: ours' artifact cache (the calibrated row loads from it); kept when given,
    so a resumed run loads ours instead of compiling it again."""
    todo = [m for m in sweep if not results.done(rows, m)]
    if todo and cache is not None:
        measure_rows(block, rows, sweep, todo, results, deadline, cache)
    elif todo:
        with tempfile.TemporaryDirectory() as scratch:
            measure_rows(block, rows, sweep, todo, results, deadline, scratch)


def measure_rows(
    block: str,
    rows: list[str],
    sweep: list[int],
    todo: list[int],
    results: Results,
    deadline: float,
    cache: str,
) -> None:
    model = make_model(block)
    compile_s = results.document["compile_s"]
    fns: dict[str, Callable[[torch.Tensor], Any]] = {}
    if "eager" in rows:
        fns["eager"] = model
    if "dynamic" in rows:
        began = time.perf_counter()
        fns["dynamic"] = compiled_dynamic(model)
        compile_s["dynamic"] = time.perf_counter() - began
    if "ours" in rows:
        began = time.perf_counter()
        fns["ours"], _ = compiled_ours(model, "ours", cache)
        compile_s["ours"] = time.perf_counter() - began
    if "calibrated" in rows:  # ours' variants again (a cache hit when ours ran), timed
        began = time.perf_counter()
        fns["calibrated"], artifacts = compiled_ours(model, "calibrated", cache)
        tables = results.document.setdefault("calibration_ms", {})
        tables[str(results.document["runs"])] = calibrate(artifacts, sweep)
        compile_s["calibrated"] = time.perf_counter() - began
    slowest = 0.0
    for m in todo:
        if time.monotonic() + 1.2 * slowest > deadline:
            print("deadline near: stopping (rerun with --resume to continue)", flush=True)
            return
        began = time.perf_counter()
        at_m = dict(fns)
        if "oracle" in rows:
            at_m["oracle"] = compiled_static(model, m)
            compile_s.setdefault("oracle", {})[str(m)] = time.perf_counter() - began
        print(f"[{block}] M={m}", flush=True)
        for row, result in measure_side_by_side(at_m, model, m).items():
            results.add(row, m, result)
        results.save()
        del at_m
        slowest = max(slowest, time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--block", choices=sorted(BLOCKS), default="mlp")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--sizes", help="comma-separated M values (default: the full sweep)")
    parser.add_argument("--out", help="result JSON (default: benchmarks/results/shapes-BLOCK.json)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--cache", help="keep ours' artifact cache here (a resume loads it)")
    parser.add_argument("--deadline-s", type=float, default=float("inf"))
    parser.add_argument("--plot", metavar="JSON", help="only print the table and plot a file")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 blocks on CPU")
    args = parser.parse_args()
    if args.smoke:
        global HIDDEN, FFN, HEADS, DEVICE, DTYPE, OPTIONS
        HIDDEN, FFN, HEADS, DEVICE, DTYPE = 64, 96, 4, "cpu", torch.float32
        OPTIONS = {}
    if args.plot:
        with open(args.plot, encoding="utf-8") as handle:
            print(summarize(json.load(handle)))
        plot(args.plot)
        return
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/shapes.py measures GPU kernels: no CUDA device here")
    from _common import RESULTS

    out = args.out or os.path.join(RESULTS, f"shapes-{args.block}.json")
    sweep = [int(m) for m in args.sizes.split(",")] if args.sizes else SWEEP
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = set(rows) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    results = Results(out, args.block, args.resume)
    run(args.block, rows, sweep, results, time.monotonic() + args.deadline_s, args.cache)
    print(summarize(results.document))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
