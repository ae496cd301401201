"""A launch-bound real model on the GPU: precompile with and without CUDA graphs, side by
side with eager, one dynamic torch.compile and upstream's reduce-overhead (CUDA graphs).

    python benchmarks/serving.py                 # the Llama below, H100/H200
    python benchmarks/serving.py --smoke         # a tiny config, a few sizes (any GPU/CPU)
    python benchmarks/serving.py --plot benchmarks/results/serving-llama.json

Model: ``transformers.LlamaForCausalLM`` from a config (hidden 2048, intermediate 5632,
4 layers, 16 heads, 4 KV heads, vocab 32000), bf16, random init, ``use_cache=False``,
batch 1, the sequence length S marked dynamic. Rows: ``eager``; ``dynamic``: one
``torch.compile``; ``reduce-overhead``: ``torch.compile(mode="reduce-overhead")``;
``ours``: ``precompile.backend(hints=[16, 256, 2048])``; ``ours+cudagraphs``: the same
with ``cudagraphs=True`` (a graph captured per S on its first call);
``ours+cudagraphs+pad``: capture sizes 1, 2, 4, ..., 512 padded (S rounds up to the next
captured size). Every row has its own Dynamo cache. At each S the rows are timed side by
side: ``--rounds`` interleaved rounds of one ``triton.testing.do_bench`` median each,
the median round counts. Also recorded: compile (and capture) time per row, and the GPU
memory each CUDA-graph row reserves for its graphs.
"""

from __future__ import annotations

import argparse
import json
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

SIZES = [1, 2, 3, 4, 8, 16, 32, 64, 100, 128, 200, 256, 512, 1024, 2048]
PAD_SIZES = [2**k for k in range(10)]  # 1 .. 512
HINTS = [16, 256, 2048]
ROWS = [
    "eager",
    "dynamic",
    "reduce-overhead",
    "ours",
    "ours+cudagraphs",
    "ours+cudagraphs+pad",
    "ours+cudagraphs, no output copy",
]


def llama(smoke: bool, device: str) -> torch.nn.Module:
    from _common import llama as build

    model: torch.nn.Module = build("tiny" if smoke else "issue", device, torch.bfloat16)
    return model


def entry_point(model: torch.nn.Module, tag: str) -> Callable[[torch.Tensor], Any]:
    """``model(ids).logits`` as a function with its own code object: Dynamo keeps one
    cache per code object, so every compiled row stays live side by side."""

    def call(ids: torch.Tensor) -> Any:
        return model(ids).logits

    code = call.__code__.replace(co_name="row_" + "".join(c if c.isalnum() else "_" for c in tag))
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _row(name: str, model: torch.nn.Module, cache: str) -> Callable[[torch.Tensor], Any]:
    import precompile

    call = entry_point(model, name)
    if name == "eager":
        return call
    if name == "dynamic":
        return torch.compile(call)
    if name == "reduce-overhead":
        return torch.compile(call, mode="reduce-overhead")
    cudagraphs: Any = None
    if name == "ours+cudagraphs":
        cudagraphs = True
    elif name == "ours+cudagraphs+pad":
        cudagraphs = {"capture_sizes": PAD_SIZES, "pad": True}
    elif name == "ours+cudagraphs, no output copy":
        cudagraphs = {"copy_outputs": False}
    return torch.compile(
        call, backend=precompile.backend(hints=HINTS, cache=cache, cudagraphs=cudagraphs)
    )


def graph_pool_bytes() -> int:
    """Bytes of the CUDA caching allocator's segments in private pools (CUDA graphs')."""
    snapshot = torch.cuda.memory._snapshot()
    return sum(
        segment["total_size"]
        for segment in snapshot["segments"]
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def _ids(size: int, vocab: int, device: str, dynamic: bool) -> torch.Tensor:
    ids = torch.randint(0, vocab, (1, size), device=device)
    if dynamic and size > 1:
        torch._dynamo.mark_dynamic(ids, 1)
    return ids


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from triton.testing import do_bench

    from _common import environment, rotating

    device = "cuda"
    sizes = [1, 3, 8, 64] if args.smoke else SIZES
    model = llama(args.smoke, device)
    vocab = model.config.vocab_size
    cache = tempfile.mkdtemp(prefix="precompile-serving-")
    calls: dict[str, Callable[[torch.Tensor], Any]] = {}
    compile_s: dict[str, float] = {}
    memory_mb: dict[str, float] = {}
    first = 8
    with torch.no_grad():
        for name in ROWS:
            calls[name] = _row(name, model, cache)
            torch.cuda.synchronize()
            pools_before = graph_pool_bytes()
            started = time.perf_counter()
            calls[name](_ids(first, vocab, device, True))
            for size in sizes:  # first calls: compiles, recompiles, captures
                calls[name](_ids(size, vocab, device, True))
            torch.cuda.synchronize()
            compile_s[name] = time.perf_counter() - started
            memory_mb[name] = (graph_pool_bytes() - pools_before) / 2**20
            print(f"[serving] {name}: ready in {compile_s[name]:.1f} s, "
                  f"+{memory_mb[name]:.0f} MiB in CUDA-graph pools", flush=True)  # fmt: skip
        if args.memory_only:
            warm = warm_start(args.smoke, cache)
            return {
                "environment": environment(device),
                "compile_s": compile_s,
                "memory_mb": memory_mb,
                "warm_start": warm,
            }
        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in ROWS}
        for size in sizes:
            inputs = [_ids(size, vocab, device, False) for _ in range(4)]
            rounds: dict[str, list[float]] = {name: [] for name in ROWS}
            for _ in range(args.rounds):
                for name in ROWS:
                    run = rotating(calls[name], [(ids,) for ids in inputs])
                    rounds[name].append(
                        float(do_bench(run, warmup=25, rep=100, return_mode="median"))
                    )
            for name in ROWS:
                results[name][str(size)] = {
                    "ms": statistics.median(rounds[name]),
                    "rounds": rounds[name],
                }
            line = "  ".join(f"{n}={results[n][str(size)]['ms']:.3f}" for n in ROWS)
            print(f"[serving] S={size}: {line}", flush=True)
    warm = warm_start(args.smoke, cache)
    return {
        "environment": environment(device),
        "warm_start": warm,
        "model": "smoke" if args.smoke else "llama-2048x4",
        "sizes": sizes,
        "rounds": args.rounds,
        "compile_s": compile_s,
        "memory_mb": memory_mb,
        "rows": results,
    }


WARM = """
import sys, time
started = time.perf_counter()
import torch, precompile
sys.path.insert(0, {here!r})
from serving import PAD_SIZES, HINTS, llama
model = llama({smoke}, "cuda")
graphs = {graphs}
compiled = torch.compile(
    lambda ids: model(ids).logits,
    backend=precompile.backend(hints=HINTS, cache={cache!r}, cudagraphs=graphs),
)
ids = torch.randint(0, 100, (1, 8), device="cuda")
torch._dynamo.mark_dynamic(ids, 1)
torch.cuda.synchronize()
began = time.perf_counter()
with torch.no_grad():
    compiled(ids)
    torch.cuda.synchronize()
    ready = time.perf_counter() - began
    began = time.perf_counter()
    compiled(torch.randint(0, 100, (1, 37), device="cuda"))
    torch.cuda.synchronize()
    new_size = time.perf_counter() - began
built = began - started - ready - new_size
print("first_call_s", ready, "new_size_s", new_size, "model_built_s", built)
"""


def warm_start(smoke: bool, cache: str) -> dict[str, Any]:
    """Fresh processes on the warm artifact cache: time of the first call (Dynamo traces,
    variants load, and with capture, every capture size is captured before it returns),
    and of a call at a new size (37: padded to 64 with capture, a plain run without)."""
    import subprocess

    found: dict[str, Any] = {}
    for label, graphs in (
        ("priming (compiles the entry point; not reported)", None),
        ("no cudagraphs", None),
        ("capture 1..512 at the first call", {"capture_sizes": PAD_SIZES, "pad": True}),
    ):
        code = WARM.format(here=HERE, smoke=smoke, graphs=repr(graphs), cache=cache)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            found[label] = {"error": out.stderr[-1500:]}
            continue
        words = out.stdout.split()
        found[label] = {words[i]: float(words[i + 1]) for i in range(0, len(words) - 1, 2)}
        print(f"[serving] warm start, {label}: {found[label]}", flush=True)
    found.pop("priming (compiles the entry point; not reported)", None)
    return found


def summarize(document: dict[str, Any]) -> str:
    from _common import table

    rows = document["rows"]
    headers = ["S", *ROWS, "ours+cg / reduce-overhead", "ours / ours+cg"]
    body = []
    for size in document["sizes"]:
        ms = {name: rows[name][str(size)]["ms"] for name in ROWS}
        body.append(
            [
                size,
                *(ms[name] for name in ROWS),
                ms["ours+cudagraphs"] / ms["reduce-overhead"],
                ms["ours"] / ms["ours+cudagraphs"],
            ]
        )
    lines = [table(headers, body), ""]
    lines.append("ready (compile + first calls at every S), s: " + ", ".join(
        f"{k} {v:.1f}" for k, v in document["compile_s"].items()))  # fmt: skip
    lines.append("GPU memory reserved during warm-up, MiB: " + ", ".join(
        f"{k} {v:.0f}" for k, v in document["memory_mb"].items()))  # fmt: skip
    for label, numbers in document.get("warm_start", {}).items():
        lines.append(f"fresh process, {label}: {numbers}")
    return "\n".join(lines)


def plot(path: str) -> None:
    from _common import result_figure

    found = result_figure(path, (8, 5))
    if found is None:
        return
    _, document, figure, axis = found
    for name in ROWS:
        sizes = document["sizes"]
        axis.plot(
            sizes, [document["rows"][name][str(s)]["ms"] for s in sizes], marker="o", label=name
        )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length S (batch 1)")
    axis.set_ylabel("ms per forward (median)")
    axis.set_title(f"Llama 2048x4 bf16 on {document['environment']['device']}")
    axis.legend()
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path.replace(".json", ".png"), dpi=120)
    print(f"wrote {path.replace('.json', '.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--memory-only", action="store_true", help="only the warm-up pass and warm starts"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results", "serving-llama.json"))
    parser.add_argument("--plot", metavar="JSON", help="only draw the plot of a result file")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot)
        return
    document = measure(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
    if args.memory_only:
        print(json.dumps(document, indent=1))
        return
    print(summarize(document))
    print(f"wrote {args.out}")
    plot(args.out)


if __name__ == "__main__":
    main()
