"""A tensor-parallel block and the per-rank script the tensor-parallel tests start.

``TPBlock`` is one rank's shard of an attention block and an MLP, written as vLLM's layers
are: column-parallel projections in (each rank holds ``HEADS`` heads and ``FFN`` hidden
units), row-parallel projections out, and a functional all-reduce after each (so Dynamo
keeps the collective in the graph). A shard's shapes do not depend on the world size, so
the same model class and shapes can be loaded into a world of another size.

Run as ``python tests/tensor_parallel_helpers.py SCENARIO DIRECTORY`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; it prints one JSON line. On CPU
the group is gloo; with ``PRECOMPILE_TP_DEVICE=cuda`` it is NCCL, one GPU per rank, bf16,
and the cold and warm runs also serve the block from CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

WIDTH, HEADS, HEAD_DIM, FFN = 32, 2, 8, 32
VOCAB_SHARD = 24  # each rank's rows of a vocab-parallel lm_head
DEVICE = os.environ.get("PRECOMPILE_TP_DEVICE", "cpu")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
HINTS = [8]  # one hint variant (sizes >= 2), no exact sizes: one compile
SEQS = [6, 2, 3, 8, 13]
# what a serving rank must not import (torch.distributed imports some of Dynamo itself)
COMPILER_MODULES = ("torch._inductor", "torch._dynamo.convert_frame", "triton.compiler")


# The tensor-parallel subgroup (``dist.new_group``), set in main: group "1" where it is the
# first group made after the default one, "2" in the remote pairs, which make a one-rank
# group first (groups created in another order).
TP_GROUP: Any = None
TP_WORLD = 1  # its size


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return fc.all_reduce(tensor, "sum", dist.group.WORLD)


def gathered_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A vocab-parallel lm_head: this rank's vocabulary rows, the logits gathered over the
    tensor-parallel subgroup along the vocabulary dim.

    Gathered along dim 0, then the ranks' blocks laid side by side, as vLLM's all-gather
    does: on torch 2.11, ``all_gather_tensor`` along another dim calls
    ``torch._utils._maybe_view_chunk_cat``, which Dynamo skips, so the graph broke before
    the collective and a backend received the linear alone."""
    local = torch.nn.functional.linear(x, weight)
    gathered = fc.all_gather_tensor(local, 0, TP_GROUP)
    return torch.cat(gathered.chunk(TP_WORLD, 0), dim=2)


class TPBlock(torch.nn.Module):
    """x + attention(x), then + mlp; each sum over ranks by an all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * HEADS * HEAD_DIM)  # column parallel
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)  # row parallel
        self.up = torch.nn.Linear(WIDTH, FFN)  # column parallel
        self.down = torch.nn.Linear(FFN, WIDTH, bias=False)  # row parallel

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' share of the attention output (to be summed over ranks)."""
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(HEADS * HEAD_DIM, dim=-1)
        q, k, v = (t.reshape(batch, seq, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        # No causal mask: with one, compile_model's hint variant of this block is guarded
        # to its hint alone (seen without collectives too; not a tensor-parallel matter).
        attended = ((q @ k.transpose(-1, -2)) / HEAD_DIM**0.5).softmax(-1) @ v
        return self.o(attended.transpose(1, 2).reshape(batch, seq, HEADS * HEAD_DIM))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + all_reduce(self.attention(x))
        return x + all_reduce(self.mlp(x))


class RankScaled(torch.nn.Module):
    """A graph that depends on the rank: ``dist.get_rank()`` is traced as a constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x * (dist.get_rank() + 1))


class VocabParallelHead(torch.nn.Module):
    """An all-gather over the subgroup (``gathered_logits``) as a model."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB_SHARD, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gathered_logits(x, self.weight)


def head_shard(rank: int) -> VocabParallelHead:
    torch.manual_seed(200 + rank)
    return VocabParallelHead().eval().to(device=_device(), dtype=DTYPE)


def shard(rank: int) -> TPBlock:
    torch.manual_seed(100 + rank)
    return TPBlock().eval().to(device=_device(), dtype=DTYPE)


def _device() -> str:
    return f"cuda:{int(os.environ.get('RANK', 0))}" if DEVICE == "cuda" else "cpu"


def eager_reference(x: torch.Tensor, world: int) -> torch.Tensor:
    """The whole (unsharded) block run eagerly in one process: every shard's partial
    sums added where the ranks' all-reduce adds them."""
    shards = [shard(r) for r in range(world)]
    with torch.no_grad():
        x = x + sum(s.attention(x) for s in shards)
        return x + sum(s.mlp(x) for s in shards)


def head_reference(x: torch.Tensor, world: int) -> torch.Tensor:
    """The unsharded lm_head: every rank's vocabulary rows, in rank order."""
    with torch.no_grad():
        weights = [head_shard(r).weight for r in range(world)]
        return torch.cat([torch.nn.functional.linear(x, w) for w in weights], -1)


def inputs(seq: int) -> torch.Tensor:
    torch.manual_seed(seq)
    return torch.randn(2, seq, WIDTH).to(device=_device(), dtype=DTYPE)


def _max_error(compiled: Any, world: int, reference: Any = eager_reference) -> float:
    worst = 0.0
    with torch.no_grad():
        for seq in SEQS:
            x = inputs(seq)
            got = compiled(x)
            worst = max(worst, float((got - reference(x, world)).abs().max()))
    return worst


def _rank_scaled_error(compiled: Any, world: int) -> float:
    x = inputs(4)
    with torch.no_grad():
        want = x * sum(r + 1 for r in range(world))
        return float((compiled(x) - want).abs().max())


def _flat_inputs(bindings: list[Any], model: torch.nn.Module, x: torch.Tensor) -> list[Any]:
    """The compiled graph's flat inputs for ``model(x)``, by the plan's bindings."""
    flat: list[Any] = []
    for kind, target in bindings:
        if kind == "parameter":
            flat.append(model.get_parameter(target))
        elif kind == "leaf":
            flat.append(x)
        else:
            flat.append(int(x.shape[target[1]]))
    return flat


def error_text(call: Any) -> str:
    """What ``call()`` raised (class and message), for a report; "no error" if nothing."""
    try:
        with torch.no_grad():
            call()
    except Exception as exc:  # the test reads the class and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _make_groups(scenario: str, world: int) -> None:
    """The tensor-parallel subgroup, made by every rank. The remote pairs make a one-rank
    group first: their subgroup is registered as "2", and "1" is rank 0 alone (rank 1,
    not a member, has no "1")."""
    global TP_GROUP, TP_WORLD
    if world < 2:
        return
    if scenario.startswith("remote"):
        dist.new_group([0])
    TP_GROUP, TP_WORLD = dist.new_group(list(range(world))), world


def _capture_head(weight: torch.Tensor) -> tuple[Any, list[str]]:
    """vLLM's way to a compiled graph: a torch.compile backend receives Dynamo's FX graph
    of ``gathered_logits`` and hands it to ``precompile.standalone_compile``. The artifact,
    and what each of its flat inputs is ("seq", "x" or "weight")."""
    import precompile

    x = inputs(6)
    torch._dynamo.mark_dynamic(x, 1)
    captured: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured["artifact"] = precompile.standalone_compile(
            gm, example_inputs, dynamic_shapes="from_graph", hints=HINTS
        )
        captured["flat"] = [
            "x" if v is x else "weight" if v is weight else "seq" for v in example_inputs
        ]
        return gm.forward

    torch._dynamo.reset()
    # fullgraph: at a graph break the backend would get pieces, and the check below would
    # take the last piece for the whole function (it did, on torch 2.11: one rank's shard)
    torch.compile(gathered_logits, backend=backend, dynamic=False, fullgraph=True)(x, weight)
    torch._dynamo.reset()
    return captured["artifact"], captured["flat"]


def _standalone_caller(artifact: Any, flat: list[str], weight: torch.Tensor) -> Any:
    """``model(x)`` through a loaded artifact: its flat inputs by name, the output [0]."""
    return lambda x: artifact(*[{"seq": x.shape[1], "x": x, "weight": weight}[n] for n in flat])[0]


def _groups_of(compiled: Any) -> list[list[Any]]:
    return [[g.name, g.size, g.backend, list(g.ranks)] for g in compiled.manifest.process_groups]


class _Report(dict[str, Any]):
    """The rank's report; each entry as it is set is also a line on stderr (with the time),
    so a rank that fails or hangs shows how far it got."""

    started = time.monotonic()

    def __setitem__(self, key: str, value: Any) -> None:
        elapsed = time.monotonic() - self.started
        print(f"rank {self.get('rank')} {elapsed:.1f} s: {key}", file=sys.stderr, flush=True)
        super().__setitem__(key, value)


def _time_remote_leases(waits: list[dict[str, Any]]) -> None:
    """Record each wait for a remote lease: how long, and whether this rank got it (to
    compile) or waited for another's entry."""
    from precompile.cache._tier import RemoteTier

    original = RemoteTier.take_lease

    def timed(self: Any, key: str) -> Any:
        started = time.monotonic()
        lease = original(self, key)
        waits.append({"key": key, "seconds": time.monotonic() - started,
                      "leased": lease is not None, "ended": time.time()})  # fmt: skip
        return lease

    RemoteTier.take_lease = timed  # type: ignore[method-assign]


def _trace_compiler_imports() -> None:
    """Print the stack that first imports each compiler package (a debugging aid)."""
    import traceback

    seen: list[str] = []

    class Finder:
        def find_spec(self, name: str, path: Any, target: Any = None) -> None:
            if name.startswith(COMPILER_MODULES) and not seen:
                seen.append(name)
                print(f"first compiler import {name}:", file=sys.stderr)
                traceback.print_stack(file=sys.stderr, limit=25)

    sys.meta_path.insert(0, Finder())  # type: ignore[arg-type]


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    if os.environ.get("PRECOMPILE_TP_LOG"):  # precompile's INFO lines on stderr
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("precompile").setLevel(logging.INFO)
        _trace_compiler_imports()
    # a hang fails the test, with stacks (and the steps done so far, from the report)
    faulthandler.dump_traceback_later(float(os.environ.get("PRECOMPILE_TP_HANG_S", 240)), exit=True)
    per_rank = os.environ.get("PRECOMPILE_TP_CACHE_PER_RANK")
    if per_rank:  # ranks as on separate machines: a local cache each
        os.environ["PRECOMPILE_CACHE_DIR"] = os.path.join(per_rank, f"rank{os.environ['RANK']}")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]))
    group_backend = "nccl" if DEVICE == "cuda" else "gloo"
    dist.init_process_group(group_backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    _make_groups(scenario, world)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    before = set(sys.modules)
    counters: dict[str, Any] = {"compiles": [], "frames": []}
    if scenario != "serve":  # a serving rank imports none of the compiler (counted here)
        from warm_start_helpers import COUNTED

        exec(COUNTED, counters)
    compiles, frames = counters["compiles"], counters["frames"]
    import precompile

    block, head = shard(rank), head_shard(rank)
    weight = head.weight.detach()
    compile_block = {"dynamic": {0: [1]}, "hints": HINTS, "sizes": []}
    # One file for both ranks: rank 0's. On GPUs each rank moves it to its own device
    # (to(): inductor's code names the device index it was compiled for).
    standalone_path = os.path.join(directory, "head-standalone.pt2c")
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "popen"
    report: dict[str, Any] = _Report(rank=rank, world=world, launcher=launcher)
    if scenario in ("cold", "warm"):
        torch.set_grad_enabled(False)  # inference artifacts (CUDA graphs capture only those)
        compiled = precompile.compile_model(block, (inputs(6),), **compile_block)
        report["block_error"] = _max_error(compiled, world)
        report["block"] = {"compiles": len(compiles), "frames": len(frames)}
        scaled = precompile.compile_model(RankScaled(), (inputs(4),))
        report["scaled_error"] = _rank_scaled_error(scaled, world)
        report["scaled"] = {"compiles": len(compiles), "frames": len(frames)}
        if DEVICE == "cuda":  # CUDA graphs per size, captured on every rank at its 2nd call
            graphed = precompile.compile_model(
                block, (inputs(6),), **compile_block, cudagraphs=True, warmup=False
            )
            for _ in range(3):  # plain, then captured, then replayed
                report["cudagraphs_error"] = _max_error(graphed, world)
            report["captured"] = [list(s) for s in graphed.artifact.captured_sizes]
        if scenario == "cold":
            compiled.save(os.path.join(directory, f"model-rank{rank}.pt2c"))
            compiled.artifact.save(path=os.path.join(directory, f"block-rank{rank}.pt2c"))
            with open(os.path.join(directory, f"bindings-rank{rank}.json"), "w") as handle:
                json.dump(compiled.plan.bindings, handle)
            torch._dynamo.reset()
            backend = precompile.backend(hints=HINTS, sizes=[])
            traced = torch.compile(shard(rank), backend=backend, dynamic=False)
            x = inputs(6)
            torch._dynamo.mark_dynamic(x, 1)
            with torch.no_grad():
                traced(x)
            report["backend_error"] = _max_error(traced, world)
            report["backend"] = {"compiles": len(compiles), "frames": len(frames)}
            artifact, flat = _capture_head(weight)
            caller = _standalone_caller(artifact, flat, weight)
            report["standalone_error"] = _max_error(caller, world, head_reference)
            report["standalone"] = {"compiles": len(compiles), "groups": _groups_of(artifact)}
            if rank == 0:
                artifact.save(path=standalone_path)
                with open(standalone_path + ".json", "w") as handle:
                    json.dump(flat, handle)
        else:
            with open(standalone_path + ".json") as handle:
                flat = json.load(handle)
            loaded = precompile.CompiledArtifact.load(path=standalone_path)
            if DEVICE == "cuda":
                loaded = loaded.to(f"cuda:{rank}")
            caller = _standalone_caller(loaded, flat, weight)
            report["standalone_error"] = _max_error(caller, world, head_reference)
            report["standalone"] = {"compiles": len(compiles), "frames": len(frames)}
        # the all-gather over the subgroup, as a whole model
        gathered = precompile.compile_model(head, (inputs(6),), **compile_block)
        report["head_error"] = _max_error(gathered, world, head_reference)
        report["head"] = {"compiles": len(compiles), "frames": len(frames),
                          "groups": _groups_of(gathered.artifact)}  # fmt: skip
    elif scenario == "serve":  # a warm serving rank: the block and the head, lean
        torch.set_grad_enabled(False)
        compiled = precompile.compile_model(block, (inputs(6),), **compile_block)
        report["block_error"] = _max_error(compiled, world)
        gathered = precompile.compile_model(head, (inputs(6),), **compile_block)
        report["head_error"] = _max_error(gathered, world, head_reference)
        report["compiler_modules"] = sorted(
            m for m in set(sys.modules) - before if m.startswith(COMPILER_MODULES)
        )
        report["lean"] = [
            v.lean is not None
            for model in (compiled, gathered)
            for v in model.artifact.manifest.variants
        ]
        if DEVICE == "cpu":  # a call after teardown: refused before its collective
            dist.destroy_process_group()
            report["after_teardown"] = error_text(lambda: compiled(inputs(6)))
    elif scenario == "mismatch":  # a world of another size, with shards of the same shapes
        torch.set_grad_enabled(False)
        from precompile import CompiledArtifact, load_model

        report["offline"] = error_text(
            lambda: precompile.compile_model(block, (inputs(6),), **compile_block, compile=False)
        )
        saved = CompiledArtifact.load(path=os.path.join(directory, "block-rank0.pt2c"))
        with open(os.path.join(directory, "bindings-rank0.json")) as handle:
            flat = _flat_inputs(json.load(handle), block, inputs(6))
        report["artifact"] = error_text(lambda: saved(*flat))
        report["load_model"] = error_text(
            lambda: load_model(block, path=os.path.join(directory, "model-rank0.pt2c"))
        )
        report["calibrate"] = error_text(lambda: saved.calibrate([4]))
        dist.destroy_process_group()
        unbound = CompiledArtifact.load(path=os.path.join(directory, "block-rank0.pt2c"))
        report["no_group"] = error_text(lambda: unbound(*flat))
        report["compiles"] = len(compiles)
    elif scenario in ("remote-cold", "remote-warm"):
        torch.set_grad_enabled(False)
        waits: list[dict[str, Any]] = []
        _time_remote_leases(waits)
        if scenario == "remote-cold":
            # Made for the subgroup registered as "1" (the cold pair's order); here "1"
            # is rank 0 alone, and rank 1 has no "1": refused, before any collective.
            with open(standalone_path + ".json") as handle:
                flat = json.load(handle)
            loaded = precompile.CompiledArtifact.load(path=standalone_path)
            report["other_order"] = error_text(lambda: _standalone_caller(loaded, flat, weight)(
                inputs(6)))  # fmt: skip
            # The cold pair's local cache holds this model compiled in the other order:
            # not this process's model (its key has the groups registered here).
            other = precompile.ArtifactCache(os.environ["PRECOMPILE_TP_OTHER_CACHE"])
            report["other_order_model"] = error_text(
                lambda: precompile.compile_model(
                    head, (inputs(6),), **compile_block, cache=other, compile=False
                )(inputs(6))
            )
        gathered = precompile.compile_model(head, (inputs(6),), **compile_block)
        report["head_error"] = _max_error(gathered, world, head_reference)
        report["head"] = {"compiles": len(compiles), "frames": len(frames),
                          "groups": _groups_of(gathered.artifact)}  # fmt: skip
        report["lease_waits"] = waits
        report["stats"] = dataclasses.asdict(precompile.ArtifactCache().stats())
    if DEVICE == "cuda" and dist.is_initialized():
        # NCCL's destroy waits for every CUDA graph that captured one of its collectives
        # to be destroyed: without the release it hung (3+ minutes on two H200s).
        faulthandler.dump_traceback_later(60, exit=True)
        started = time.perf_counter()
        if os.environ.get("PRECOMPILE_TP_KEEP_GRAPHS") != "1":
            report["released_graphs"] = precompile.release_cuda_graphs()
        dist.destroy_process_group()
        report["teardown_s"] = time.perf_counter() - started
        faulthandler.cancel_dump_traceback_later()
    print(json.dumps(report), flush=True)
    reports = os.environ.get("PRECOMPILE_TP_REPORTS")
    if reports:  # torchrun interleaves its ranks' stdout
        with open(os.path.join(reports, f"{scenario}-rank{rank}.json"), "w") as handle:
            json.dump(report, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
