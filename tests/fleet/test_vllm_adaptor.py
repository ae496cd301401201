"""vLLM's InductorStandaloneAdaptor on precompile: its calls, cold and in a fresh process.

The calls vLLM makes of ``standalone_compile`` and ``CompiledArtifact`` (reproduced in
``vllm_adaptor_helpers``): Dynamo captures a decoder layer whose attention is a custom op;
``split_module`` cuts the graph at it; each compiled piece is compiled for the token range
[1, 256] and for the compile size 8, saved (binary, or unpacked) under vLLM's cache layout,
and called as returned in the compiling process. A fresh process loads every artifact with
``CompiledArtifact.load`` and calls it through vLLM's wrapper, which takes
``graph_output[0]`` where the piece's graph returns a bare value. Both adaptor generations:
the older one, and the one for torch >= 2.13 (``donate_graph_module=True``, the
``FakeTensorMode`` patch, the saveability check). Every output, of the model and of each
compiled piece, is compared with eager at 1, 5, 8, 37 and 256 tokens.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import vllm_adaptor_helpers as harness
from conftest import ROOT, run_python
from test_tensor_parallel import one_rank_compiles, run_ranks
from torch._inductor import standalone_compile as upstream_standalone

# The newer adaptor passes ``donate_graph_module``, which torch's standalone_compile takes
# from 2.13 (vLLM pairs that adaptor with such a torch); the GPU machines run 2.11.
NEWER_TORCH = "donate_graph_module" in inspect.signature(upstream_standalone).parameters
_NEEDS_NEWER = pytest.mark.skipif(
    not NEWER_TORCH, reason="the newer adaptor needs a torch whose standalone_compile "
    "takes donate_graph_module (2.13 and later)"
)  # fmt: skip
CONFIGS = ["older-binary", "older-unpacked", "newer-binary", "newer-unpacked"]
PARAMS = [pytest.param(c, marks=_NEEDS_NEWER) if c.startswith("newer") else c for c in CONFIGS]


@pytest.fixture(scope="module")
def vllm_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def cold(vllm_root: str) -> Callable[[str], list[str]]:
    """The compiling process, once per configuration: its mismatches with eager."""
    done: dict[str, list[str] | Exception] = {}

    def result(config: str) -> list[str]:
        if config not in done:
            generation, fmt = config.split("-")
            try:
                done[config] = harness.run("precompile", generation, fmt, vllm_root, "compile")  # type: ignore[arg-type]
            except Exception as exc:
                done[config] = exc
        outcome = done[config]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return result


@pytest.fixture(scope="module")
def warm(vllm_root: str, cold: Callable[[str], list[str]]) -> dict[str, Any]:
    """One fresh process (and a fresh inductor cache) loads every configuration that the
    compiling process saved."""
    saved = []
    for config in CONFIGS if NEWER_TORCH else CONFIGS[:2]:
        try:
            cold(config)
        except Exception:
            continue  # its own cold test reports why
        saved.append(config)
    if not saved:
        return {}
    out = run_python(
        f"""
        import json, sys
        sys.path.insert(0, "tests")
        import vllm_adaptor_helpers as harness
        report = harness.fresh_process_report("precompile", {vllm_root!r}, {saved!r})
        print("REPORT " + json.dumps(report))
        """,
        env={"TORCHINDUCTOR_CACHE_DIR": os.path.join(vllm_root, "fresh-inductor-cache")},
    )
    line = next(line for line in out.splitlines() if line.startswith("REPORT "))
    report: dict[str, Any] = json.loads(line[len("REPORT ") :])
    return report


@pytest.mark.parametrize("config", PARAMS)
def test_compiling_process_outputs_match_eager(
    cold: Callable[[str], list[str]], config: str
) -> None:
    problems = cold(config)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("config", PARAMS)
def test_artifacts_are_saved_under_vllms_layout(
    cold: Callable[[str], list[str]], vllm_root: str, config: str
) -> None:
    cold(config)
    generation, fmt = config.split("-")
    cache_dir = harness.vllm_cache_dir(vllm_root, generation, fmt)  # type: ignore[arg-type]
    handles = harness.read_handles(cache_dir)
    ranges = [harness.Range(*harness.RANGE)] + [harness.Range(s, s) for s in harness.COMPILE_SIZES]
    expected = {harness.range_key(r, index) for r in ranges for index in (0, 1)}
    assert set(handles) == expected  # two compiled pieces around the attention op
    for key, (handle_key, path) in handles.items():
        assert handle_key == key
        assert path == os.path.join(cache_dir, key)
        assert (os.path.isdir if fmt == "unpacked" else os.path.isfile)(path), path


@pytest.mark.subprocess
@pytest.mark.parametrize("config", PARAMS)
def test_fresh_process_outputs_match_eager(warm: dict[str, Any], config: str) -> None:
    assert config in warm, f"{config} was not saved: see its compiling-process test"
    problems = warm[config]
    assert isinstance(problems, list), problems  # the error the fresh process raised
    assert problems == [], "\n".join(problems)


# -- tensor parallel: vLLM's own collective ops ------------------------------------------
# vLLM's layers sum over ranks with ``torch.ops.vllm.all_reduce(x, group_name="tp:0")``, a
# custom op naming a group of vLLM's registry. ``vllm_tensor_parallel_helpers.py`` runs the
# decoder layer sharded over two gloo ranks that way, through vLLM's adaptor (saved under
# ``rank_<r>_0``), ``precompile.backend`` and ``compile_model``.
VLLM_TP_SCRIPT = os.path.join(ROOT, "tests", "vllm_tensor_parallel_helpers.py")


@pytest.fixture(scope="module")
def vllm_tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = str(tmp_path_factory.mktemp("vllm-tp"))
    cache = os.path.join(directory, "cache")

    def ranks(scenario: str, world: int) -> list[dict[str, Any]]:
        return run_ranks(scenario, world, directory, cache, script=VLLM_TP_SCRIPT)

    return {"cold": ranks("cold", 2), "warm": ranks("warm", 2), "mismatch": ranks("mismatch", 1)}


@pytest.mark.subprocess
@_NEEDS_NEWER  # its ranks run the newer adaptor
def test_tensor_parallel_graphs_with_vllms_collective_ops_match_the_unsharded_layer(
    vllm_tp: dict[str, Any],
) -> None:
    """Before, every such graph was refused ('process group tp:0 is not registered'), and
    the adaptor's compile-size pieces failed on the layer's per-head views."""
    for report in vllm_tp["cold"] + vllm_tp["warm"]:
        for path in ("vllm", "backend", "model"):
            assert report[f"{path}_error"] < 1e-5, (path, report)
        # the op's group is vLLM's: the world the graph was compiled in stands for it
        assert report["process_groups"] == [["0", 2, "gloo", [0, 1]]], report
    cold = vllm_tp["cold"]
    # the ranks' graphs are identical: each is compiled once, by one rank or the other
    # (size 8; the range's hint variant and its variant at 1), the other rank loads it
    assert sum(r["vllm_compiles"] for r in cold) == 3, cold
    assert one_rank_compiles([r["backend_compiles"] for r in cold]), cold
    for report in vllm_tp["warm"]:
        assert report["vllm_compiles"] == report["backend_compiles"] == 0, report
        assert report["model_compiles"] == 0, report


@pytest.mark.subprocess
@_NEEDS_NEWER  # its ranks run the newer adaptor
def test_vllm_tensor_parallel_artifact_in_another_world_is_refused_not_summed(
    vllm_tp: dict[str, Any],
) -> None:
    """A world of one, with rank 0's shard: vLLM's 'tp:0' there is a group of one rank,
    and the graph would have returned rank 0's share of the sum as the sum."""
    (report,) = vllm_tp["mismatch"]
    assert report["vllm"].startswith("IncompatibleArtifactError"), report
    assert "process group '0' of 2 ranks [0, 1] (gloo)" in report["vllm"], report
    assert "has 1 ranks [0]" in report["vllm"], report
