"""Hostile inputs never end a serving process: a seeded, bounded fuzzer (issue 48).

Cases (``hostile_fuzz_child.py``) vary sizes, dtypes, values and the relations between
inputs (a mask's rows against the batch, positions past a table, index values outside
the dim they gather from) over synthetic graphs with indirect indexing and the tiny
Llama. They run in child processes: a child that dies is restarted after the case that
ended it, which is recorded as a death. The goal: 0 deaths, and every case equal to
eager or refused with one of precompile's errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hostile_fuzz_child import CASES

ROOT = Path(__file__).resolve().parents[2]


def run_cases(cache: str) -> tuple[dict[int, dict[str, Any]], list[tuple[int, int, str]]]:
    """Every case's report, and (case, exit status, stderr's tail) per case a child died in."""
    reports: dict[int, dict[str, Any]] = {}
    deaths: list[tuple[int, int, str]] = []
    first = 0
    while first < CASES:
        child = subprocess.run(
            [sys.executable, "tests/hostile_fuzz_child.py", cache, str(first)],
            capture_output=True, text=True, cwd=ROOT, timeout=600,
            env={**os.environ, "PRECOMPILE_CACHE_DIR": cache},
        )  # fmt: skip
        lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        if not lines or "ready" not in lines[0]:
            raise AssertionError(f"the child did not start ({child.returncode}):\n{child.stderr}")
        for line in lines[1:]:
            reports[line["case"]] = line
        done = max((line["case"] for line in lines[1:]), default=first - 1)
        if child.returncode == 0 and done == CASES - 1:
            break
        deaths.append((done + 1, child.returncode, child.stderr[-600:]))
        first = done + 2
    return reports, deaths


def test_hostile_inputs_end_no_process_and_get_eager_or_a_clear_error(tmp_path: Path) -> None:
    reports, deaths = run_cases(str(tmp_path))
    assert not deaths, deaths
    assert len(reports) == CASES
    bad = [r for r in reports.values() if r["verdict"] not in ("equal", "clear error")]
    assert not bad, bad
    verdicts = [r["verdict"] for r in reports.values()]
    # the fuzzer reaches both outcomes, and index failures among the refusals
    assert verdicts.count("equal") >= 8 and verdicts.count("clear error") >= 8
    said = " ".join(r["said"] for r in reports.values())
    assert "IndexOutOfRangeError" in said and "compiled kernel's check" in said
