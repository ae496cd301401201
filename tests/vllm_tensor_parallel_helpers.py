"""vLLM's tensor parallelism on precompile: the per-rank script the tests start.

vLLM does not trace ``torch.distributed._functional_collectives``: its layers call
``torch.ops.vllm.all_reduce(x, group_name="tp:0")``, a custom op whose ``group_name``
names a group in vLLM's own registry (a ``GroupCoordinator`` holding a torch group made
by ``dist.new_group``), not a name torch registered. Written here the same way (op,
registry and coordinator, reduced), on the decoder layer of ``vllm_adaptor_helpers``
sharded as vLLM's column- and row-parallel layers shard it: each rank one head, half the
MLP, and the row-parallel biases on rank 0.

The graph is compiled three ways: by vLLM's ``InductorStandaloneAdaptor`` (the calls of
``vllm_adaptor_helpers``: a compile size and the range, saved under ``rank_<r>_0``, loaded
by a fresh pair), by ``precompile.backend`` and by ``precompile.compile_model``. Every
output is compared with the unsharded layer run eagerly in one process.

Run as ``python tests/vllm_tensor_parallel_helpers.py SCENARIO DIRECTORY`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; it prints one JSON line.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_adaptor_helpers as harness
from tensor_parallel_helpers import error_text

SHARDS = 2  # the layer is sharded for two ranks, whatever world loads it
HEAD_DIM = harness.HIDDEN // harness.HEADS
SIZES = [1, 5, 8, 37, 256]  # the range's ends, the compile size, others
BACKEND_SIZES = [5, 8, 37]  # precompile.backend / compile_model: sizes >= 2

_groups: dict[str, Any] = {}  # vLLM's registry: unique name -> weakref to a coordinator


class GroupCoordinator:
    """vLLM's ``GroupCoordinator``, reduced: a torch group of its own under a unique name."""

    def __init__(self, ranks: list[int], name: str) -> None:
        self.unique_name = name
        self.device_group = dist.new_group(ranks)
        _groups[name] = weakref.ref(self)


@torch.library.custom_op("precompile_vllm_tp_test::all_reduce", mutates_args=())
def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """vLLM's ``all_reduce`` op: out of place, the group looked up by its name."""
    group = _groups[group_name]()
    out = tensor.clone()
    dist.all_reduce(out, group=group.device_group)
    return out


@all_reduce.register_fake
def _(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


class ShardedDecoderLayer(torch.nn.Module):
    """One rank's shard of ``harness.TinyDecoderLayer``: q/k/v and ``up`` by rows
    (column parallel), ``o_proj`` and ``down`` by columns (row parallel, then summed over
    the ranks by the op), the norms whole."""

    def __init__(self, full: torch.nn.Module, rank: int, tp: GroupCoordinator) -> None:
        super().__init__()
        self.tp_name = tp.unique_name
        hidden, heads = harness.HIDDEN, harness.HEADS
        self.local_heads = heads // SHARDS
        width = self.local_heads * HEAD_DIM
        self.input_norm, self.post_norm = full.input_norm, full.post_norm
        self.q_norm, self.k_norm = full.q_norm, full.k_norm
        # this rank's heads of q, of k and of v (the fused weight holds them in that order)
        index = torch.cat(
            [
                torch.arange(p + rank * width, p + (rank + 1) * width)
                for p in (0, hidden, 2 * hidden)
            ]
        )
        self.qkv = _linear(full.qkv.weight[index], full.qkv.bias[index])
        columns = slice(rank * width, (rank + 1) * width)
        self.o_proj = _linear(full.o_proj.weight[:, columns], _rank0_bias(full.o_proj, rank))
        ffn = full.up.out_features // SHARDS
        block = slice(rank * ffn, (rank + 1) * ffn)
        self.up = _linear(full.up.weight[block], full.up.bias[block])
        self.down = _linear(full.down.weight[:, block], _rank0_bias(full.down, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).chunk(3, dim=-1)
        q = self.q_norm(q.reshape(tokens, self.local_heads, HEAD_DIM)).reshape(tokens, -1)
        k = self.k_norm(k.reshape(tokens, self.local_heads, HEAD_DIM)).reshape(tokens, -1)
        qh, kh, vh = (
            t.reshape(tokens, self.local_heads, HEAD_DIM).transpose(0, 1) for t in (q, k, v)
        )
        attended = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        attended = attended.transpose(0, 1).reshape(tokens, -1)
        reduce = torch.ops.precompile_vllm_tp_test.all_reduce
        x = x + reduce(self.o_proj(attended), group_name=self.tp_name)
        return x + reduce(self.down(F.silu(self.up(self.post_norm(x)))), group_name=self.tp_name)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def _rank0_bias(layer: torch.nn.Linear, rank: int) -> torch.Tensor:
    """A row-parallel layer's bias, added once: by rank 0 (vLLM's RowParallelLinear)."""
    return layer.bias if rank == 0 else torch.zeros_like(layer.bias)


def tokens(size: int) -> torch.Tensor:
    torch.manual_seed(size)
    return torch.randn(size, harness.HIDDEN)


def max_error(call: Any, full: torch.nn.Module, sizes: list[int]) -> float:
    """The largest difference from the unsharded layer run eagerly, over ``sizes``."""
    worst = 0.0
    with torch.inference_mode():
        for size in sizes:
            x = tokens(size)
            out = call(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            worst = max(worst, float((out - full(x)).abs().max()))
    return worst


def vllm_compile(
    shard: torch.nn.Module, directory: str, rank: int, mode: str
) -> tuple[Any, list[Any]]:
    """vLLM's backend over the whole graph (no splitting op): a piecewise backend whose one
    piece is the graph, compiled for size 8 and the range, or loaded from ``rank_<r>_0``."""
    cache_dir = os.path.join(directory, "torch_compile_cache", "tp", f"rank_{rank}_0", "backbone")
    os.makedirs(cache_dir, exist_ok=True)
    impl = harness.implementation("precompile")
    adaptor = harness.StandaloneAdaptor(impl, "newer", "binary", cache_dir)
    handles = harness.read_handles(cache_dir) if mode == "load" else {}
    built: list[tuple[Any, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        piece = harness.PiecewiseBackend("graph", gm, 0, adaptor, mode, handles, None)  # type: ignore[arg-type]
        built.append((piece, list(example_inputs)))
        return piece

    torch._dynamo.reset()
    with torch.inference_mode():  # as every later call: an inference tensor
        x = tokens(harness.TRACE_TOKENS)
        torch._dynamo.mark_dynamic(x, 0)
        torch.compile(shard, backend=backend, fullgraph=True)(x)
    if mode == "compile":
        harness.write_handles(cache_dir, handles)
    piece, example_inputs = built[0]
    index = next(i for i, v in enumerate(example_inputs) if v is x)

    def call(y: torch.Tensor) -> Any:
        flat = [
            y if i == index else y.shape[0] if isinstance(v, torch.SymInt) else v
            for i, v in enumerate(example_inputs)
        ]
        return piece(*flat)

    return call, example_inputs


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test, with stacks
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    from warm_start_helpers import COUNTED

    counters: dict[str, Any] = {}
    exec(COUNTED, counters)
    compiles = counters["compiles"]
    import precompile

    # every rank builds the whole layer from the same seed, keeps its shard
    full = harness.build_model()
    tp = GroupCoordinator(list(range(world)), "tp:0")
    shard_rank = rank if scenario != "mismatch" else 0
    shard = ShardedDecoderLayer(full, shard_rank, tp).eval()
    report: dict[str, Any] = {"rank": rank, "world": world}
    if scenario in ("cold", "warm"):
        mode = "compile" if scenario == "cold" else "load"
        call, _ = vllm_compile(shard, directory, rank, mode)
        report["vllm_error"] = max_error(call, full, SIZES)
        report["vllm_compiles"] = len(compiles)
        before = len(compiles)
        torch._dynamo.reset()
        traced = torch.compile(
            shard, backend=precompile.backend(hints=[8], sizes=[]), dynamic=False
        )
        with torch.inference_mode():  # as every later call: an inference tensor
            x = tokens(harness.TRACE_TOKENS)
            torch._dynamo.mark_dynamic(x, 0)
            traced(x)
        report["backend_error"] = max_error(traced, full, BACKEND_SIZES)
        report["backend_compiles"] = len(compiles) - before
        before = len(compiles)
        with torch.inference_mode():
            model = precompile.compile_model(
                shard, (tokens(6),), dynamic={0: [0]}, hints=[8], sizes=[]
            )
        report["model_error"] = max_error(model, full, BACKEND_SIZES)
        report["model_compiles"] = len(compiles) - before
        report["process_groups"] = [
            [g.name, g.size, g.backend, list(g.ranks)]
            for g in model.artifact.manifest.process_groups
        ]
    elif scenario == "mismatch":  # a world of one, with rank 0's shard of the two-rank layer
        # vLLM's group "tp:0" here has one rank: run, the graph would sum one shard's share
        report["vllm"] = error_text(lambda: vllm_compile(shard, directory, 0, "load")[0](tokens(5)))
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
