"""vLLM's InductorStandaloneAdaptor on precompile: its calls, cold and in a fresh process.

The calls vLLM makes of ``standalone_compile`` and ``CompiledArtifact`` (reproduced in
``vllm_adaptor_harness``): Dynamo captures a decoder layer whose attention is a custom op;
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

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import vllm_adaptor_harness as harness
from conftest import run_python

CONFIGS = ["older-binary", "older-unpacked", "newer-binary", "newer-unpacked"]


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
    for config in CONFIGS:
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
        import vllm_adaptor_harness as harness
        report = harness.fresh_process_report("precompile", {vllm_root!r}, {saved!r})
        print("REPORT " + json.dumps(report))
        """,
        env={"TORCHINDUCTOR_CACHE_DIR": os.path.join(vllm_root, "fresh-inductor-cache")},
    )
    line = next(line for line in out.splitlines() if line.startswith("REPORT "))
    report: dict[str, Any] = json.loads(line[len("REPORT ") :])
    return report


@pytest.mark.parametrize("config", CONFIGS)
def test_compiling_process_outputs_match_eager(
    cold: Callable[[str], list[str]], config: str
) -> None:
    problems = cold(config)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("config", CONFIGS)
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
@pytest.mark.parametrize("config", CONFIGS)
def test_fresh_process_outputs_match_eager(warm: dict[str, Any], config: str) -> None:
    assert config in warm, f"{config} was not saved: see its compiling-process test"
    problems = warm[config]
    assert isinstance(problems, list), problems  # the error the fresh process raised
    assert problems == [], "\n".join(problems)
