"""Import time of each entry point, in fresh processes (this CPU).

    python benchmarks/imports.py [--repo DIR] [--runs N]

- compile: ``import precompile`` and touch ``precompile.standalone_compile``;
- serve: ``import precompile`` and touch ``precompile.CompiledArtifact`` (what a server
  loading by tag or path needs);
- CLI: ``python -m precompile cache ls`` on an empty cache, the whole command.

Each is the median of ``--runs`` fresh interpreters; the table also says whether Dynamo
and our compile side were imported. ``--repo`` measures another checkout (an older
commit, for a before/after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PROBE = """
import sys, time
started = time.perf_counter()
import precompile
{touch}
elapsed = time.perf_counter() - started
print(elapsed, "torch._dynamo" in sys.modules, "precompile._standalone" in sys.modules)
"""
ENTRY_POINTS = {
    "compile": "precompile.standalone_compile",
    "serve": "precompile.CompiledArtifact",
}


def _run(repo: str, code: str) -> tuple[float, bool, bool]:
    env = {**os.environ, "PYTHONPATH": repo}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    seconds, dynamo, compile_side = out.stdout.split()
    return float(seconds), dynamo == "True", compile_side == "True"


def _cli(repo: str, root: str) -> float:
    env = {**os.environ, "PYTHONPATH": repo}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "precompile", "cache", "--root", root, "ls"],
        cwd=repo,
        env=env,
        capture_output=True,
        check=True,
    )
    return time.perf_counter() - started


def main() -> None:
    from _common import environment, table, write_json

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", default=os.path.dirname(HERE))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--label", default="current")
    args = parser.parse_args()
    rows = []
    for name, touch in ENTRY_POINTS.items():
        runs = [_run(args.repo, PROBE.format(touch=touch)) for _ in range(args.runs)]
        rows.append([name, statistics.median(r[0] for r in runs), runs[0][1], runs[0][2]])
    with tempfile.TemporaryDirectory() as root:
        seconds = [_cli(args.repo, root) for _ in range(args.runs)]
    rows.append(["CLI (whole command)", statistics.median(seconds), "-", "-"])
    headers = ["entry point", "seconds (median)", "imports Dynamo", "imports our compile side"]
    print(table(headers, rows))
    document = {
        **environment("cpu"),
        "label": args.label,
        "runs": args.runs,
        "rows": [dict(zip(headers, row, strict=True)) for row in rows],
    }
    print(f"wrote {write_json(f'imports-{args.label}.json', document)}")


if __name__ == "__main__":
    main()
