"""Model-level warm start (``python benchmarks/warmstart.py --model``): a transformers Llama
served by a fresh process, one run of each row side by side.

Rows, each a fresh process: ``ours-model cold`` (``compile_model`` on an empty cache:
trace + compile + first call), ``ours-model warm`` (``compile_model`` finds the model in
the cache without tracing), ``ours-backend cold``/``warm`` (``torch.compile`` with
``precompile.backend``: Dynamo traces every time), ``torch.compile cold``/``warm`` (plain
inductor, empty vs warm inductor cache), ``aot_compile`` (upstream
``torch.compile(...).aot_compile`` saved, then loaded in a fresh process; with
``skip_all_guards_unsafe``, the only filter it works with on this model). Warm rows get an
empty inductor and Triton cache of their own, except what their row's build left.

Per row: seconds from the call (``compile_model``, the first compiled call, or the
load) to the first output; the first call at a new size after warm-up; process start to
first output; and the Dynamo frames traced, inductor compiles and compiler processes
(gcc, ptxas, ...) the process started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ROWS = [
    "ours-model cold",
    "ours-model warm",
    "ours-backend cold",
    "ours-backend warm",
    "torch.compile cold",
    "torch.compile warm",
    "aot_compile build",
    "aot_compile load",
]
FIRST, NEW = 128, 200
HINTS = [16, 256, 2048]


def llama(device: str) -> Any:
    import torch
    from _common import llama as build

    if device == "cpu":
        return build("tiny", device, torch.float32, max_positions=1024)
    return build("issue", device, torch.bfloat16)


def child(row: str, workdir: str, device: str) -> dict[str, Any]:
    from _common import watch_processes

    started = time.perf_counter()
    spawned = watch_processes()
    import torch

    sys.path.insert(0, ROOT)
    from _common import count_tracing_and_compiles, is_compiler

    import precompile

    frames, compiles = count_tracing_and_compiles()
    imported = time.perf_counter()
    model = llama(device)
    vocab = model.config.vocab_size

    def ids(size: int) -> Any:
        return torch.randint(0, vocab, (1, size), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    built = time.perf_counter()
    result: dict[str, Any] = {}
    with torch.no_grad():
        first = ids(FIRST)
        torch._dynamo.mark_dynamic(first, 1)
        if row.startswith("ours-model"):
            compiled = precompile.compile_model(
                model, (first,), dynamic={0: [1]}, hints=HINTS, warmup="background"
            )
            out = compiled(first)
        elif row.startswith("ours-backend"):
            fn = torch.compile(model, backend=precompile.backend(hints=HINTS))
            out = fn(first)
        elif row.startswith("torch.compile"):
            fn = torch.compile(model)
            out = fn(first)
        elif row == "aot_compile build":
            torch._dynamo.config.enable_aot_compile = True

            def call(ids: Any) -> Any:
                return model(ids).logits

            aot = torch.compile(
                call,
                fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
            ).aot_compile(((first,), {}))
            aot.save_compiled_function(
                os.path.join(workdir, "aot.bin"), external_data={"model": model}
            )
            out = aot(first)
        else:  # aot_compile load
            with open(os.path.join(workdir, "aot.bin"), "rb") as handle:
                loaded = torch.compiler.load_compiled_function(
                    handle, external_data={"model": model}
                )
            out = loaded(first)
        sync()
        first_output = time.perf_counter() - built
        result["first_output_s"] = first_output
        if row.startswith("ours-model"):
            compiled.wait_warm(timeout=600)
        began = time.perf_counter()
        if row.startswith("ours-model"):
            compiled(ids(NEW))
        elif row == "aot_compile load":
            loaded(ids(NEW))
        elif row != "aot_compile build":
            fn(ids(NEW))
        sync()
        result["new_size_s"] = time.perf_counter() - began
    del out
    result.update(
        import_s=imported - started,
        model_built_s=built - imported,
        from_start_s=time.perf_counter() - started - result["new_size_s"],
        dynamo_frames=len(frames),
        inductor_compiles=len(compiles),
        processes=len(spawned),
        compiler_processes=sum(1 for p in spawned if is_compiler(p)),
        spawned=sorted(set(spawned)),
    )
    return result


def run_all(device: str) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="warmstart-model-")
    caches = {
        "ours-model": tempfile.mkdtemp(prefix="wm-ours-model-"),
        "ours-backend": tempfile.mkdtemp(prefix="wm-ours-backend-"),
        "inductor": tempfile.mkdtemp(prefix="wm-inductor-"),
    }
    results: dict[str, Any] = {}
    for row in ROWS:
        env = {
            **os.environ,
            "PRECOMPILE_CACHE_DIR": caches["ours-backend" if "backend" in row else "ours-model"],
            # warm rows of ours and aot get an empty inductor and triton cache: nothing
            # of theirs is compiled; plain torch.compile warm reuses its build's cache.
            "TORCHINDUCTOR_CACHE_DIR": caches["inductor"]
            if row.startswith("torch.compile")
            else tempfile.mkdtemp(prefix="wm-inductor-empty-"),
            "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="wm-triton-"),
        }
        command = [sys.executable, os.path.join(HERE, "warmstart.py"), "--model-child", row,
                   "--workdir", workdir, "--device", device]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode != 0:
            results[row] = {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
        else:
            results[row] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"[warmstart] {row}: {results[row]}", flush=True)
    return results


def report(document: dict[str, Any]) -> str:
    from _common import table

    headers = [
        "row",
        "call to first output s",
        "new size after warm-up s",
        "process start to first output s",
        "Dynamo frames",
        "inductor compiles",
        "compiler processes",
    ]
    rows = []
    for row, r in document["rows"].items():
        if "error" in r:
            rows.append([row, f"fails: {r['error'][:80]}", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [row, r["first_output_s"], r["new_size_s"], r["from_start_s"], r["dynamo_frames"],
             r["inductor_compiles"], r["compiler_processes"]]
        )  # fmt: skip
    return table(headers, rows)


def plot(document: dict[str, Any], path: str) -> None:
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    rows = [(k, v) for k, v in document["rows"].items() if "error" not in v]
    figure, axis = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    for number, (_, r) in enumerate(rows):
        parts = [("import", r["import_s"]), ("model built", r["model_built_s"]),
                 ("call to first output", r["first_output_s"])]  # fmt: skip
        left = 0.0
        for color, (label, width) in enumerate(parts):
            axis.barh(
                number, width, left=left, color=f"C{color}", label=label if number == 0 else None
            )
            left += width
        axis.text(left, number, f" {r['first_output_s']:.2f} s", va="center")
    axis.set_yticks(range(len(rows)), [row for row, _ in rows])
    axis.invert_yaxis()
    axis.set_xlabel("seconds from process start")
    axis.set_title(f"Llama warm start on {document['device']} (torch {document['torch']})")
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")
