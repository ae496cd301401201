"""Tensor parallel on CPU: two processes over gloo, a block with two all-reduces in its graph
and a vocab-parallel lm_head whose logits are all-gathered over a ``dist.new_group``.

One cold pair of ranks compiles into a shared local cache (module fixture), then a fresh
warm pair and a world of one process read what it left. Then ranks as on separate
machines: a local cache each and one shared remote tier, cold (started by Popen), then
warm with new empty local caches (started by torchrun). The per-rank script is
``tests/tensor_parallel_helpers.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
from conftest import ROOT, run_python

from precompile.cache import LAYOUT, ArtifactCache

SCRIPT = os.path.join(ROOT, "tests", "tensor_parallel_helpers.py")
TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_ranks(
    scenario: str,
    world: int,
    directory: str,
    cache: str,
    env: dict[str, str] | None = None,
    script: str = SCRIPT,
) -> list[dict[str, Any]]:
    """Start ``world`` processes of one gloo group running ``script``, all at once; their
    JSON reports by rank. A rank that hangs (a collective no other rank makes) fails the
    test, never the suite."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, scenario, directory],
            cwd=ROOT,
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PRECOMPILE_CACHE_DIR": cache,
                **(env or {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            failed = f"{scenario} rank failed ({proc.returncode}):\n{err[-4000:]}"
            assert proc.returncode == 0, failed
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted(reports, key=lambda r: r["rank"])


def run_torchrun(
    scenario: str, world: int, directory: str, env: dict[str, str]
) -> list[dict[str, Any]]:
    """``run_ranks`` started as users start ranks: ``torchrun --standalone`` sets RANK,
    WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT (its own rendezvous on a free port)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), SCRIPT, scenario, directory]  # fmt: skip
    env = {**os.environ, **env, "PRECOMPILE_TP_REPORTS": directory}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"torchrun {scenario} failed:\n{done.stderr[-4000:]}"
    reports = []
    for rank in range(world):
        with open(os.path.join(directory, f"{scenario}-rank{rank}.json")) as handle:
            reports.append(json.load(handle))
    return sorted(reports, key=lambda r: r["rank"])


def one_rank_compiles(counts: list[int]) -> bool:
    """One rank compiled (its graph's variants: the hint one, and one at 1 where the hint
    variant's guards leave 1 out), every other rank compiled nothing."""
    return sorted(counts)[-1] > 0 and sorted(counts)[:-1] == [0] * (len(counts) - 1)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = str(tmp_path_factory.mktemp("tensor-parallel"))
    cache = os.path.join(directory, "cache")
    return {
        "directory": directory,
        "cache": cache,
        "reports": run_ranks("cold", 2, directory, cache),
    }


def test_cold_pair_matches_eager_and_one_rank_compiles_each_shared_graph(
    cold: dict[str, Any],
) -> None:
    reports = cold["reports"]
    for report in reports:
        # compile_model and precompile.backend, at sequence lengths 6, 2, 3, 8 and 13,
        # against the unsharded block run eagerly in one process
        assert report["block_error"] < TOLERANCE, report
        assert report["backend_error"] < TOLERANCE, report
        assert report["scaled_error"] == 0.0, report
    # Both ranks trace the same block graph: one compiles it, the other waits and loads
    # (before, the second rank waited on the model's lock while the first ran its traced
    # call's all-reduce: a deadlock).
    # compile_model traces the block twice (its sequence at 2 or more, and at 1): each of
    # the two graphs compiled by one rank, loaded by the other (2 compiles in all)
    assert sum(r["block"]["compiles"] for r in reports) == 2, reports
    # precompile.backend traces the same block to the same graph (under no_grad, as
    # compile_model's): it finds that graph's entry, on both ranks.
    backend = [r["backend"]["compiles"] - r["scaled"]["compiles"] for r in reports]
    assert backend == [0, 0]


def test_all_gather_over_a_subgroup_matches_eager_and_records_the_group(
    cold: dict[str, Any],
) -> None:
    """The vocab-parallel lm_head: logits all-gathered over ``dist.new_group([0, 1])``
    (registered as "1"), through ``standalone_compile`` called on the FX graph a
    torch.compile backend received (vLLM's way) and through ``compile_model``."""
    reports = cold["reports"]
    subgroup = [["1", 2, "gloo", [0, 1]]]
    for report in reports:
        assert report["standalone_error"] < TOLERANCE, report
        assert report["head_error"] < TOLERANCE, report
        assert report["standalone"]["groups"] == subgroup, report
        assert report["head"]["groups"] == subgroup, report
    # each a graph both ranks trace alike: one rank compiles, the other loads
    standalone = [r["standalone"]["compiles"] - r["backend"]["compiles"] for r in reports]
    assert one_rank_compiles(standalone), standalone
    head = [r["head"]["compiles"] - r["standalone"]["compiles"] for r in reports]
    assert sum(head) == 2, head  # compile_model's two traces (at 2 or more, at 1), once each
    keyed = {e.factors.get("process_groups") for e in ArtifactCache(cold["cache"]).entries()}
    assert "[('1', 2, 'gloo', [0, 1])]" in keyed, keyed


def test_ranks_share_one_entry_per_identical_graph_and_rank_dependent_graphs_do_not(
    cold: dict[str, Any],
) -> None:
    reports = cold["reports"]
    # RankScaled's graph holds dist.get_rank() as a constant: each rank compiles its own,
    # and each gets its own rank's sum (3x), never the other rank's graph (2x)
    assert [r["scaled"]["compiles"] - r["block"]["compiles"] for r in reports] == [1, 1]
    entries = ArtifactCache(cold["cache"]).entries()
    graphs = [e for e in entries if "model_class" not in e.factors]
    models = [e for e in entries if "model_class" in e.factors]
    # the block (compile_model's and backend's trace), RankScaled on rank 0 and on rank 1;
    # the lm_head through standalone_compile and through compile_model
    # the block's two traces (compile_model's at lengths of 2 or more, shared with the
    # backend's trace, and its trace at 1), RankScaled on rank 0 and on rank 1; the lm_head
    # through standalone_compile and compile_model's two traces of it
    assert len(graphs) == 7, [e.factors for e in graphs]
    on_world = [e for e in graphs if e.factors["process_groups"] == "[('0', 2, 'gloo', [0, 1])]"]
    assert len(on_world) == 4, [e.factors for e in graphs]
    # compile_model keys per rank (its key is computed without tracing, so it cannot
    # see whether the trace holds the rank); the compiled code is the graph's entry's
    assert len(models) == 6
    assert len({e.factors["distributed"] for e in models}) == 2


def test_fresh_pair_warm_starts_with_no_trace_and_no_compile(cold: dict[str, Any]) -> None:
    for report in run_ranks("warm", 2, cold["directory"], cold["cache"]):
        assert report["block"] == {"compiles": 0, "frames": 0}, report
        assert report["scaled"] == {"compiles": 0, "frames": 0}, report
        assert report["block_error"] < TOLERANCE and report["scaled_error"] == 0.0, report
        # the lm_head's file saved by rank 0 of the cold pair, CompiledArtifact.load-ed
        assert report["standalone"] == {"compiles": 0, "frames": 0}, report
        assert report["standalone_error"] < TOLERANCE, report
        assert report["head"]["compiles"] == 0 and report["head"]["frames"] == 0, report
        assert report["head_error"] < TOLERANCE, report


def test_a_serving_pair_runs_its_collective_graphs_with_no_compiler_imported(
    cold: dict[str, Any],
) -> None:
    """The graphs hold all-reduces and an all-gather (torch's ``_c10d_functional`` ops):
    on the lean path, as any graph of torch's own operators (before, each such graph
    loaded through upstream's path, importing inductor and Dynamo: a slower warm start)."""
    for report in run_ranks("serve", 2, cold["directory"], cold["cache"]):
        assert report["block_error"] < TOLERANCE and report["head_error"] < TOLERANCE, report
        assert report["lean"] and all(report["lean"]), report
        assert report["compiler_modules"] == [], report
        # (it reached the all-reduce: "Could not resolve the process group ... 0")
        assert report["after_teardown"].startswith("IncompatibleArtifactError"), report
        assert "no group is registered under that name" in report["after_teardown"], report


def test_another_world_size_is_a_miss_or_a_refusal_before_any_collective(
    cold: dict[str, Any],
) -> None:
    """A world of one process whose shard has the shapes of the two-rank world's: the
    compiled graph would sum over the wrong ranks (or fail inside generated code)."""
    (report,) = run_ranks("mismatch", 1, cold["directory"], cold["cache"])
    assert report["offline"].startswith("ArtifactNotFoundError"), report
    assert "differs in: distributed" in report["offline"], report
    assert report["artifact"].startswith("IncompatibleArtifactError"), report
    assert "process group '0' of 2 ranks [0, 1] (gloo)" in report["artifact"], report
    assert "has 1 ranks [0]" in report["artifact"], report
    assert report["load_model"].startswith("IncompatibleArtifactError"), report
    assert "traced on rank 0 of 2 (gloo)" in report["load_model"], report
    # calibrating would run collectives a different number of times on each rank
    assert report["calibrate"].startswith("InvalidOptionError"), report
    # no process group at all: our error, before the graph's first kernel
    assert report["no_group"].startswith("IncompatibleArtifactError"), report
    assert "no group is registered under that name" in report["no_group"], report
    assert report["compiles"] == 0


@pytest.fixture(scope="module")
def remote(cold: dict[str, Any]) -> dict[str, Any]:
    """A cold pair of ranks as on two machines: an empty local cache each, one shared
    ``file://`` remote tier. Its ranks make their groups in another order than the cold
    pair's (a one-rank group first: the subgroup is "2")."""
    directory = cold["directory"]
    shared = os.path.join(directory, "remote")
    env = {
        "PRECOMPILE_REMOTE_CACHE": f"file://{shared}",
        "PRECOMPILE_TP_CACHE_PER_RANK": os.path.join(directory, "remote-cold-local"),
        "PRECOMPILE_TP_OTHER_CACHE": cold["cache"],
    }
    reports = run_ranks("remote-cold", 2, directory, cold["cache"], env)
    return {"shared": shared, "env": env, "reports": reports}


def _wait_after_entry(shared: str, wait: dict[str, Any]) -> float:
    """Seconds between the compiling rank's upload of an entry and the end of the other
    rank's wait for it (the lease's polling delay)."""
    entry = os.path.join(shared, LAYOUT, "entries", wait["key"] + ".json")
    return float(wait["ended"] - os.stat(entry).st_mtime)


def test_remote_tier_one_rank_compiles_each_graph_the_other_waits_and_downloads(
    remote: dict[str, Any],
) -> None:
    reports = remote["reports"]
    for report in reports:
        assert report["head_error"] < TOLERANCE, report
        assert report["head"]["groups"] == [["2", 2, "gloo", [0, 1]]], report
    # single flight across machines: each of compile_model's two traces of the head (its
    # length at 2 or more, and at 1) is the same graph on both ranks: one rank compiles
    # it, the other waits for the lease and downloads it (or, reaching it after the
    # upload, downloads it without waiting: which one depends on the ranks' timing)
    assert sum(r["head"]["compiles"] for r in reports) == 2, reports
    assert sum(r["stats"]["remote_hits"] for r in reports) >= 2, reports
    waited = [w for r in reports for w in r["lease_waits"] if not w["leased"]]
    assert len(waited) <= 2, [r["lease_waits"] for r in reports]
    for wait in waited:
        lag = _wait_after_entry(remote["shared"], wait)
        print(f"waited {wait['seconds']:.2f} s for {wait['key'][:12]}, {lag:.2f} s after upload")
        assert lag < 2.0, wait  # polled at most 1 s apart
    # the two graphs' entries once each, and each rank's model entry (keyed per rank)
    assert sum(r["stats"]["remote_uploads"] for r in reports) == 4
    # the file compiled for the subgroup registered as "1" ([0, 1]): here rank 0's "1"
    # is [0] and rank 1 has none; each rank refuses before any collective
    rank0, rank1 = (r["other_order"] for r in reports)
    assert rank0.startswith("IncompatibleArtifactError"), rank0
    assert "group '1' of 2 ranks [0, 1] (gloo), but here that group has 1 ranks [0]" in rank0
    assert rank1.startswith("IncompatibleArtifactError"), rank1
    assert "no group is registered under that name" in rank1, rank1
    # the cold pair's cache holds this model compiled over its "1": another key here
    for report in reports:
        assert report["other_order_model"].startswith("ArtifactNotFoundError"), report
        assert "differs in: distributed" in report["other_order_model"], report


def test_torchrun_pair_with_empty_local_caches_warm_starts_from_the_remote_tier(
    remote: dict[str, Any], tmp_path: Any
) -> None:
    env = {**remote["env"], "PRECOMPILE_TP_CACHE_PER_RANK": str(tmp_path / "fresh-local")}
    reports = run_torchrun("remote-warm", 2, str(tmp_path), env)
    for report in reports:
        assert report["launcher"] == "torchrun", report
        assert report["head"]["compiles"] == 0 and report["head"]["frames"] == 0, report
        assert report["head_error"] < TOLERANCE, report
        assert report["stats"]["remote_hits"] == 1, report  # its model entry, from the remote
        assert report["lease_waits"] == [], report  # nothing to compile, no lease


@pytest.mark.gpu
def test_nccl_pair_matches_eager_warm_starts_and_replays_cuda_graphs(tmp_path: Any) -> None:
    """The same block in bf16 over NCCL, one GPU per rank: compile_model and
    precompile.backend against the unsharded block run eagerly on one GPU, CUDA graphs
    captured on both ranks, then a fresh pair with no trace and no compile."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cache, env = str(tmp_path / "cache"), {"PRECOMPILE_TP_DEVICE": "cuda"}
    cold = run_ranks("cold", 2, str(tmp_path), cache, env)
    # One compile per graph for the pair: the key leaves out the device index, one rank
    # compiles each of compile_model's two traces, the other waits and moves its artifact
    # to its own device (before, each rank compiled both: the index was in the key).
    assert sum(r["block"]["compiles"] for r in cold) == 2, cold
    head = [r["head"]["compiles"] - r["standalone"]["compiles"] for r in cold]
    assert sum(head) == 2, cold
    warm = run_ranks("warm", 2, str(tmp_path), cache, env)
    errors = ("block_error", "cudagraphs_error", "backend_error", "standalone_error", "head_error")
    for report in cold + warm:
        for key in errors:
            if key in report:
                assert report[key] < 5e-2, report  # bf16, summed in another order
        assert report["captured"], report
        # the vocab-parallel lm_head over the subgroup: the artifact holds the all-gather
        # (on torch 2.11 a graph break had left the backend the linear alone: one shard)
        assert report["head"]["groups"] == [["1", 2, "nccl", [0, 1]]], report
    for report in cold:
        assert report["standalone"]["groups"] == [["1", 2, "nccl", [0, 1]]], report
    for report in warm:
        assert report["block"] == {"compiles": 0, "frames": 0}, report
    for report in cold + warm:
        # the graphs holding NCCL all-reduces released, destroy_process_group returns
        # (it hung while they were alive: NCCL waits for each to be destroyed)
        assert report["released_graphs"] > 0 and report["teardown_s"] < 30, report
    for report in run_ranks("serve", 2, str(tmp_path), cache, env):  # on the lean path
        assert report["block_error"] < 5e-2 and report["head_error"] < 5e-2, report
        # (a machine whose environment sets a variable inductor's config reads, as CXX,
        # imports that config for the cache key: compiler modules, but no variant upstream)
        assert report["lean"] and all(report["lean"]), report


def test_the_group_a_module_holds_is_part_of_the_models_identity() -> None:
    """Found by a client trial: the same model in the same world, its row-parallel layer
    holding another group (``new_group([rank])`` for ``WORLD``), found the model compiled
    for the first and summed over the wrong ranks. A held group is now a setting of the
    model, by name, as its ints and strings are (no tracing needed)."""
    out = run_python(
        """
        import os, socket, json
        import torch, torch.distributed as dist
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1")
        dist.init_process_group("gloo")
        from precompile.runtime._model_identity import model_identity
        class Row(torch.nn.Module):
            def __init__(self, group):
                super().__init__()
                self.linear = torch.nn.Linear(4, 4)
                self.group = group
        world, alone = dist.group.WORLD, dist.new_group([0])
        same = [model_identity(Row(g))["model_settings"] for g in (world, world)]
        other = model_identity(Row(alone))["model_settings"]
        print("REPORT " + json.dumps([same[0] == same[1], same[0] == other]))
        dist.destroy_process_group()
        """
    )
    line = next(line for line in out.splitlines() if line.startswith("REPORT "))
    assert json.loads(line[len("REPORT ") :]) == [True, False]
