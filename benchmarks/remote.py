"""A fresh process with an empty local cache serves its first request from the remote tier,
against compiling (``python benchmarks/remote.py [--repeats N]``).

The workload is the CPU Llama of ``warmstart.py --model`` (2 layers, sequence dim
dynamic, hints 16/256/2048) through ``precompile.compile_model``. Rows, each a fresh
process with its own empty inductor cache:

- ``compile``: empty local cache, empty remote: trace, compile, upload (S3 remote).
- ``remote s3``: empty local cache; the entry comes from an S3 API server on localhost
  (moto in server mode, through s3fs, as with real S3; no network latency, so a real
  bucket adds its round trips and bandwidth).
- ``remote file://``: empty local cache; the entry comes from a shared directory.
- ``local``: the local cache a ``remote s3`` row filled (what every later start sees).

The three serving rows run with ``PRECOMPILE_OFFLINE=1``: they cannot compile, so a
number there is a fetch and a load, never a compile that happened to be fast.
Reported per row (median of ``--repeats`` fresh processes): seconds from the
``compile_model`` call to the first output, process start to first output, and the
Dynamo frames, inductor compiles and remote hits the process made.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
FIRST = 128
HINTS = [16, 256, 2048]


def child(local: str, remote: str, options: str) -> dict[str, Any]:
    started = time.perf_counter()
    import torch

    sys.path.insert(0, ROOT)
    from _warmstart_model import llama

    import precompile
    from precompile.cache import ArtifactCache

    from _common import count_tracing_and_compiles

    frames, compiles = count_tracing_and_compiles()
    model = llama("cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, FIRST))
    store = ArtifactCache(local, remote=remote, remote_options=json.loads(options))
    before = store.stats()
    called = time.perf_counter()
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (ids,), dynamic={0: [1]}, hints=HINTS, cache=store, warmup="background"
        )
        compiled(ids)
    done = time.perf_counter()
    stats = store.stats()
    return {
        "fetched": stats.remote_hits - before.remote_hits,
        "first_output_s": done - called,
        "from_start_s": done - started,
        "dynamo_frames": len(frames),
        "inductor_compiles": len(compiles),
        "uploaded": stats.remote_uploads - before.remote_uploads,
        "local_bytes": stats.size,
    }


def _run(local: str, remote: str, options: dict[str, Any], offline: bool) -> dict[str, Any]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="remote-bench-inductor-"),
        "PRECOMPILE_OFFLINE": "1" if offline else "0",
    }
    command = [sys.executable, __file__, "--child", local, remote, json.dumps(options)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("LOCAL", "REMOTE", "OPTIONS"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from remote_helpers import S3Server

    from _common import environment, median, table, write_json

    server = S3Server()
    work = tempfile.mkdtemp(prefix="remote-bench-")
    s3 = {"url": server.url(), "options": server.options}
    shared = {"url": f"file://{work}/shared", "options": {}}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        runs["compile"] = [_run(f"{work}/builder", s3["url"], s3["options"], offline=False)]
        # the shared directory gets the same entries, as a user would push them
        pushed = subprocess.run(
            [sys.executable, "-m", "precompile", "cache", "--root", f"{work}/builder", "push",
             shared["url"]], cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        if pushed.returncode != 0:
            raise SystemExit(pushed.stderr)
        for n in range(args.repeats):
            for row, remote in (("remote s3", s3), ("remote file://", shared)):
                local = f"{work}/{row.split()[1].strip(':/')}-{n}"
                runs.setdefault(row, []).append(
                    _run(local, remote["url"], remote["options"], offline=True)
                )
            runs.setdefault("local", []).append(
                _run(f"{work}/s3-{n}", s3["url"], s3["options"], offline=True)
            )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows: dict[str, dict[str, Any]] = {}
    for row, samples in runs.items():
        rows[row] = {
            "first_output_s": median([s["first_output_s"] for s in samples]),
            "from_start_s": median([s["from_start_s"] for s in samples]),
            "samples": samples,
        }
    document = {**environment("cpu"), "workload": "Llama 2 layers, hidden 64", "rows": rows}
    path = write_json("remote-cpu.json", document)
    compile_s = rows["compile"]["first_output_s"]
    lines = []
    for row, r in rows.items():
        first = r["samples"][0]
        speedup = "-" if row == "compile" else f"{compile_s / r['first_output_s']:.1f}x"
        lines.append(
            [row, r["first_output_s"], speedup, r["from_start_s"], first["dynamo_frames"],
             first["inductor_compiles"], first["fetched"]]
        )  # fmt: skip
    headers = ["row", "call to first output s", "faster than compile",
               "process start to first output s", "Dynamo frames", "inductor compiles",
               "entries fetched"]  # fmt: skip
    print(table(headers, lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
