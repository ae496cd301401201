"""Tensor parallel on two GPUs: a hand-sharded Llama (TP=2, NCCL) served by ours with and
without CUDA graphs, side by side with eager, torch.compile and reduce-overhead; and a
fresh two-rank warm start against the single-GPU warm start of the whole model.

    python benchmarks/tensor_parallel.py           # the serving issue's Llama, 2 GPUs
    python benchmarks/tensor_parallel.py --smoke   # a tiny config, few sizes

Model: ``transformers.LlamaForCausalLM`` (hidden 2048, intermediate 5632, 4 layers, 16
heads, 4 KV heads, vocab 32000), bf16, random init, batch 1, ``use_cache=False``. Each rank
keeps its half of the heads (q/k/v rows, o_proj columns) and of the MLP (gate/up rows,
down_proj columns); o_proj and down_proj are followed by a functional all-reduce, so the
traced graph holds the collectives. Embeddings and lm_head are replicated.

Phases, each in fresh processes with empty inductor and Triton caches (one shared
artifact cache): ``cold`` (2 ranks: compile, check against eager, steady state of every
row), ``warm`` (2 ranks: ``compile_model`` from the cache, first call at S=128),
``single-cold`` and ``single-warm`` (the whole model on one GPU, not distributed).
Steady state: at each S, every row is called 3 times, then timed over a fixed number of
calls with CUDA events (every rank makes the same calls: a count set by time would
differ between ranks, and so would their collectives), in interleaved rounds; the median
round counts. Rank 0's times are reported, the slower rank's beside them in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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

SIZES = [1, 8, 64, 128, 512]
ALL_ROWS = "eager,torch.compile,reduce-overhead,ours,ours+cudagraphs"
# eager is always a row: every other row is checked against it
ROWS = ["eager", *(r for r in os.environ.get("TP_ROWS", ALL_ROWS).split(",") if r != "eager")]
FIRST = 128  # the warm start's first call


def shard_llama(model: torch.nn.Module, rank: int, world: int) -> torch.nn.Module:
    """Keep this rank's heads and MLP columns; all-reduce after o_proj and down_proj."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    class RowParallel(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fc.all_reduce(self.linear(x), "sum", dist.group.WORLD)

    def rows(linear: torch.nn.Linear) -> None:
        part = linear.out_features // world
        linear.weight = torch.nn.Parameter(linear.weight[rank * part : (rank + 1) * part].clone())
        linear.out_features = part

    def columns(linear: torch.nn.Linear) -> None:
        part = linear.in_features // world
        linear.weight = torch.nn.Parameter(
            linear.weight[:, rank * part : (rank + 1) * part].clone()
        )
        linear.in_features = part

    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj,
                       mlp.up_proj):  # fmt: skip
            rows(linear)
        columns(attention.o_proj)
        columns(mlp.down_proj)
        attention.o_proj = RowParallel(attention.o_proj)
        mlp.down_proj = RowParallel(mlp.down_proj)
    return model


def entry_point(model: torch.nn.Module, tag: str) -> Callable[[torch.Tensor], Any]:
    """``model(ids).logits`` with its own code object (one Dynamo cache per row)."""

    def call(ids: torch.Tensor) -> Any:
        return model(ids).logits

    code = call.__code__.replace(co_name="row_" + "".join(c if c.isalnum() else "_" for c in tag))
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def ids_of(seq: int, vocab: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seq)
    return torch.randint(0, vocab, (1, seq), generator=generator).to(device)


def timed(fn: Callable[[], Any], calls: int) -> float:
    if not torch.cuda.is_available():  # the CPU smoke run (gloo)
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) * 1e3 / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker(phase: str, out: str, smoke: bool) -> None:
    from _common import count_tracing_and_compiles, llama

    frames, compiles = count_tracing_and_compiles()
    import faulthandler

    import precompile

    faulthandler.dump_traceback_later(float(os.environ.get("TP_HANG_S", 900)), exit=True)
    torch.set_grad_enabled(False)  # inference artifacts: CUDA graphs capture only those

    distributed = not phase.startswith("single")
    rank = int(os.environ.get("RANK", 0))
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo")
    model = llama("tiny" if smoke else "issue", device, torch.bfloat16)
    vocab = model.config.vocab_size
    report: dict[str, Any] = {"phase": phase, "rank": rank}
    full = None
    if distributed:
        if phase == "cold":
            with torch.no_grad():
                full = {s: model(ids_of(s, vocab, device)).logits for s in (1, 8, FIRST)}
        model = shard_llama(model, rank, int(os.environ["WORLD_SIZE"]))
    # Exact sizes: on the H200 (torch 2.11) this model's hint variants came out guarded to
    # their hint alone (s == 16, s == 256), so a dynamic variant would serve no other S.
    options = {"dynamic": {0: [1]}, "sizes": SIZES, "warmup": False}
    if phase in ("warm", "single-warm", "single-cold"):
        if distributed:
            # NCCL makes its communicator at a group's first collective (eager pays it
            # too): timed apart, before the call, as a server that warms its group would
            sync()
            started = time.perf_counter()
            dist.barrier()
            sync()
            report["first_collective_s"] = time.perf_counter() - started
        profile = None
        if os.environ.get("TP_PROFILE") and rank == 0:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        sync()
        started = time.perf_counter()
        compiled = precompile.compile_model(model, (ids_of(FIRST, vocab, device),), **options)
        sync()
        report["load_s"] = time.perf_counter() - started
        with torch.no_grad():
            compiled(ids_of(FIRST, vocab, device))
        sync()
        report["call_to_first_output_s"] = time.perf_counter() - started
        if profile is not None:
            import pstats

            profile.disable()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
        report["compiles"], report["frames"] = len(compiles), len(frames)
        if phase == "warm" and cuda:  # CUDA graphs on ranks, from the same entry
            graphed = precompile.compile_model(
                model, (ids_of(FIRST, vocab, device),), **options, cudagraphs=True
            )
            with torch.no_grad():
                for seq in (1, 8, FIRST):
                    ids = ids_of(seq, vocab, device)
                    plain = compiled(ids).logits  # a CompiledModel returns a ModelOutput
                    for _ in range(3):
                        replayed = graphed(ids).logits
                    report[f"cudagraphs_vs_plain_S{seq}"] = float((replayed - plain).abs().max())
            report["captured"] = [list(s) for s in graphed.artifact.captured_sizes]
    if phase == "cold":
        rows: dict[str, Any] = {}
        build_s: dict[str, float] = {}
        for name in (
            ROWS if cuda else [n for n in ROWS if "cudagraphs" not in n and n != "reduce-overhead"]
        ):
            started = time.perf_counter()
            call = entry_point(model, name)
            if name == "torch.compile":
                call = torch.compile(call)
            elif name == "reduce-overhead":
                call = torch.compile(call, mode="reduce-overhead")
            elif name.startswith("ours"):
                graphs = name == "ours+cudagraphs"
                compiled = precompile.compile_model(
                    model, (ids_of(FIRST, vocab, device),), **options, cudagraphs=graphs or None
                )
                call = compiled  # a CompiledModel returns a ModelOutput
            rows[name] = call
            with torch.no_grad():
                for seq in SIZES:  # compiles (and captures) every size once, same order on ranks
                    ids = ids_of(seq, vocab, device)
                    if seq > 1:
                        torch._dynamo.mark_dynamic(ids, 1)
                    rows[name](ids)
            sync()
            build_s[name] = time.perf_counter() - started
            report[f"compiles_after_{name}"] = len(compiles)
        report["build_s"] = build_s

        def logits(name: str, ids: torch.Tensor) -> torch.Tensor:
            value = rows[name](ids)
            return value if isinstance(value, torch.Tensor) else value.logits

        errors: dict[str, float] = {}
        with torch.no_grad():
            assert full is not None
            for seq in (1, 8, FIRST):
                ids = ids_of(seq, vocab, device)
                eager = logits("eager", ids)
                errors[f"eager_tp_vs_one_gpu_S{seq}"] = float((eager - full[seq]).abs().max())
                for name in list(rows)[1:]:
                    errors[f"{name}_vs_eager_tp_S{seq}"] = float(
                        (logits(name, ids) - eager).abs().max()
                    )
        report["errors"] = errors
        rounds, calls = (2, 5) if smoke else (3, 20)
        sizes = SIZES if not smoke else SIZES[:2]
        times: dict[str, dict[int, list[float]]] = {n: {s: [] for s in sizes} for n in rows}
        with torch.no_grad():
            for seq in sizes:
                ids = ids_of(seq, vocab, device)
                for _ in range(rounds):
                    for name in rows:
                        for _ in range(3):
                            logits(name, ids)
                        times[name][seq].append(timed(lambda n=name, i=ids: logits(n, i), calls))
        report["ms"] = {
            n: {s: statistics.median(v) for s, v in t.items()} for n, t in times.items()
        }
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    if distributed:
        # NCCL's destroy waits for every CUDA graph holding one of its collectives to be
        # destroyed (precompile.release_cuda_graphs() releases ours; reduce-overhead's
        # graph trees hold theirs): the report is written, so leave at once
        os._exit(0)


def launch(phase: str, world: int, directory: str, cache: str, smoke: bool) -> list[Any]:
    """One process per rank, fresh inductor and Triton caches, one artifact cache."""
    fresh = tempfile.mkdtemp(prefix=f"tp-{phase}-", dir=directory)
    env = {
        **os.environ,
        "PRECOMPILE_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(fresh, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(fresh, "triton"),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + len(os.listdir(directory))),
        "PYTHONUNBUFFERED": "1",
    }
    outs = [os.path.join(fresh, f"rank{r}.json") for r in range(world)]
    argv = [sys.executable, os.path.abspath(__file__), "--phase", phase]
    procs = [
        subprocess.Popen(
            [*argv, "--out", outs[r], *(["--smoke"] if smoke else [])],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(world)
    ]
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise SystemExit(f"phase {phase} failed ({proc.returncode})")
    reports = []
    for path in outs:
        with open(path, encoding="utf-8") as handle:
            reports.append(json.load(handle))
    return reports


def plot(path: str) -> None:
    """ms per call against S for every row on rank 0 of the cold pair (log scales)."""
    from _common import result_figure

    made = result_figure(path, (7, 4.2))
    if made is None:
        return
    plt, document, figure, axis = made
    ms = document["cold"][0]["ms"]
    for row, by in ms.items():
        points = sorted((int(s), t) for s, t in by.items())
        axis.plot(*zip(*points, strict=True), marker="o", label=row)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length S (batch 1)")
    axis.set_ylabel("ms per call, rank 0")
    where = document["environment"]
    axis.set_title(f"Llama TP={where.get('gpus', 2)}: {where['device']}", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    png = path.replace(".json", ".png")
    figure.savefig(png, dpi=110)
    plt.close(figure)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--phase")
    parser.add_argument("--out")
    parser.add_argument("--json", default=None)
    parser.add_argument("--phases", default="cold,warm,single-cold,single-warm")
    parser.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result file")
    args = parser.parse_args()
    if args.phase:
        worker(args.phase, args.out, args.smoke)
        return
    if args.plot:
        plot(args.plot)
        return
    from _common import environment, table, write_json

    directory = tempfile.mkdtemp(prefix="tp-bench-")
    cache = os.path.join(directory, "cache")
    started = time.perf_counter()
    where = "cuda" if torch.cuda.is_available() else "cpu"
    document: dict[str, Any] = {"environment": environment(where), "smoke": args.smoke}
    document["environment"]["gpus"] = torch.cuda.device_count() if where == "cuda" else 0
    default = "tensor-parallel-smoke.json" if args.smoke else "tensor-parallel-h200.json"
    name = args.json or default
    for phase in args.phases.split(","):
        world = 1 if phase.startswith("single") else 2
        document[phase] = launch(phase, world, directory, cache, args.smoke)
        print(f"{phase} done at {time.perf_counter() - started:.0f} s", flush=True)
        write_json(name, document)  # what is done so far survives a run cut short
    ranks = document.get("cold", [])
    sizes = [s for s in SIZES if ranks and str(s) in ranks[0]["ms"]["eager"]]
    names = list(ranks[0]["ms"]) if ranks else []
    print(table(["S", *names], [[s, *(f"{ranks[0]['ms'][n][str(s)]:.3f}" for n in names)]
                                for s in sizes]))  # fmt: skip
    for phase in ("warm", "single-warm", "single-cold"):
        for report in document.get(phase, []):
            print(phase, "rank", report["rank"], {k: v for k, v in report.items() if k != "ms"})
    for report in ranks:
        print("cold rank", report["rank"], report["errors"], report["build_s"])
    written = write_json(name, document)
    print("wrote", written)
    if ranks:
        plot(written)


if __name__ == "__main__":
    main()
