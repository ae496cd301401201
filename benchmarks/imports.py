"""Import time of each entry point, in fresh processes (this CPU).

    python benchmarks/imports.py [--repo DIR] [--runs N]

- compile: ``import precompile`` and touch ``precompile.standalone_compile``;
- serve: ``import precompile`` and touch ``precompile.CompiledArtifact`` (what a server
  loading by tag or path needs);
- serve, load + first call: the same, then ``CompiledArtifact.load`` of a saved artifact
  (the demo MLP, 4 variants, built once by this script) and its first call, with an empty
  inductor cache: everything a serving process does before its first output;
- CLI: ``python -m precompile cache ls`` on an empty cache, the whole command.

Each is the median of ``--runs`` fresh interpreters, timed from after ``import torch``
(whose own median is the first row); the table also says whether Dynamo and our compile
side were imported. ``--repo`` measures another checkout (an older commit, for a
before/after; the artifact is built by this checkout).
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
began = time.perf_counter()
import torch
started = time.perf_counter()
if {torch_only}:
    started = began
else:
    import precompile
    {touch}
elapsed = time.perf_counter() - started
print(elapsed, "torch._dynamo" in sys.modules, "precompile._standalone" in sys.modules)
"""
SERVE_FIRST_CALL = """
art = precompile.CompiledArtifact.load(path={artifact!r})
layout = torch.load({layout!r})
x = torch.randn(5, 256)
args = [layout["constants"].get(i, 5 if i in layout["sizes"] else x) for i in range(layout["n"])]
with torch.no_grad():
    art(*args)
"""
ENTRY_POINTS = {
    "import torch": "",
    "compile": "precompile.standalone_compile",
    "serve": "precompile.CompiledArtifact",
}
BUILD = """
import sys, torch, precompile
sys.path.insert(0, "examples")
from demo import EXACT_SIZES, HINTS, MLP, capture
torch.manual_seed(0)
gm, example_inputs = capture(MLP().eval(), torch.randn(4, 256))
with torch.no_grad():
    art = precompile.standalone_compile(
        gm, example_inputs, hints=HINTS, sizes=EXACT_SIZES, cache=False
    )
art.save(path={artifact!r})
torch.save({{
    "n": len(example_inputs),
    "constants": {{i: t.detach() for i, t in enumerate(example_inputs)
                  if isinstance(t, torch.Tensor) and tuple(t.shape) != (4, 256)}},
    "sizes": [i for i, t in enumerate(example_inputs) if isinstance(t, torch.SymInt)],
}}, {layout!r})
"""


def _run(repo: str, code: str) -> tuple[float, bool, bool]:
    env = {
        **os.environ,
        "PYTHONPATH": repo,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="imports-inductor-"),
    }
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
    parser.add_argument(
        "--label", default="cpu", help="writes results/imports-LABEL.json (git keeps history)"
    )
    args = parser.parse_args()
    built = tempfile.mkdtemp(prefix="imports-artifact-")
    artifact, layout = os.path.join(built, "mlp.pt2c"), os.path.join(built, "layout.pt")
    here = os.path.dirname(HERE)
    subprocess.run(
        [sys.executable, "-c", BUILD.format(artifact=artifact, layout=layout)],
        cwd=here,
        env={**os.environ, "PYTHONPATH": here},
        check=True,
        capture_output=True,
    )
    probes = dict(ENTRY_POINTS)
    probes["serve, load + first call"] = "precompile.CompiledArtifact" + SERVE_FIRST_CALL.format(
        artifact=artifact, layout=layout
    )
    rows = []
    for name, touch in probes.items():
        code = PROBE.format(touch=touch.replace("\n", "\n    "), torch_only=not touch)
        runs = [_run(args.repo, code) for _ in range(args.runs)]
        rows.append([name, statistics.median(r[0] for r in runs), runs[0][1], runs[0][2]])
    with tempfile.TemporaryDirectory() as root:
        seconds = [_cli(args.repo, root) for _ in range(args.runs)]
    rows.append(["CLI (whole command)", statistics.median(seconds), "-", "-"])
    headers = [
        "entry point",
        "seconds after import torch (median)",
        "imports Dynamo",
        "imports our compile side",
    ]
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
