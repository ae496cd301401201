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
BASELINE = "import torch, transformers"
ROWS = [
    "ours-model cold",
    "ours-model warm",
    "ours-backend cold",
    "ours-backend warm",
    "torch.compile cold",
    "torch.compile warm",
    "aot_compile build",
    "aot_compile load",
    BASELINE,
]
REPEATED = ("ours-model warm", BASELINE)  # rows of the goals: medians of this many runs
REPEATS = 3
COMPILER_MODULES = ("torch._inductor", "triton.compiler")
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

    imported_torch = time.perf_counter()
    sys.path.insert(0, ROOT)
    from _common import is_compiler

    if row == BASELINE:
        import transformers  # noqa: F401

        return {"from_start_s": time.perf_counter() - started}
    serving = row == "ours-model warm"
    if not serving:
        # counting Dynamo frames and inductor compiles imports the compiler: every row but
        # the serving one (which must not import it: checked at the end instead)
        import precompile

        from _common import count_tracing_and_compiles

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
    before = list(sys.modules)
    if serving:  # imported after the snapshot (its imports count as the serving path's),
        import precompile  # and before the call's clock starts, as a server's

        precompile.compile_model  # noqa: B018  (``from precompile import compile_model``)

    call_started = time.perf_counter()
    result: dict[str, Any] = {}
    with torch.no_grad():
        first = ids(FIRST)
        if row.startswith("ours-model"):
            compiled = precompile.compile_model(
                model, (first,), dynamic={0: [1]}, hints=HINTS, warmup="background"
            )
            out = compiled(first)
        elif row.startswith("ours-backend"):
            torch._dynamo.mark_dynamic(first, 1)
            fn = torch.compile(model, backend=precompile.backend(hints=HINTS))
            out = fn(first)
        elif row.startswith("torch.compile"):
            torch._dynamo.mark_dynamic(first, 1)
            fn = torch.compile(model)
            out = fn(first)
        elif row == "aot_compile build":
            torch._dynamo.mark_dynamic(first, 1)
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
        first_output = time.perf_counter() - call_started
        result["first_output_s"] = first_output
        from_start = time.perf_counter() - started
        known = set(before)
        added = [name for name in list(sys.modules) if name not in known]
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
    if serving:
        compiler = sorted(m for m in added if m.startswith(COMPILER_MODULES))
        # nothing of the compiler imported by the serving path (transformers imports some
        # of Dynamo and inductor itself): nothing traced or compiled by construction
        frames, compiles = ([1] if compiler else []), ([1] if compiler else [])
        result["compiler_modules"] = compiler
        result["serving_modules"] = added
        result["modules_before"] = before
    result.update(
        import_s=imported - started,
        import_torch_s=imported_torch - started,
        model_built_s=built - imported,
        from_start_s=from_start,
        dynamo_frames=len(frames),
        inductor_compiles=len(compiles),
        processes=len(spawned),
        compiler_processes=sum(1 for p in spawned if is_compiler(p)),
        spawned=sorted(set(spawned)),
    )
    return result


def imports_beyond(before: list[str], modules: list[str]) -> float:
    """Seconds a fresh process takes to import ``modules`` (in their order) once it has
    imported ``before`` (what the serving process held when it had built its model):
    the imports a serving path adds to a transformers server's own."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"before": before, "modules": modules}, handle)
    code = (
        "import importlib, json, sys, time, torch\n"
        f"lists = json.load(open({handle.name!r}))\n"
        "def load(names):\n"
        "    for name in names:\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except BaseException:\n"
        "            pass\n"
        "load(lists['before'])\n"
        "t = time.perf_counter()\n"
        "load(lists['modules'])\n"
        "print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    os.unlink(handle.name)
    return float(out.stdout.strip().splitlines()[-1])


def run_all(device: str, only: list[str] | None = None) -> dict[str, Any]:
    """Every row (or those in ``only``) once, then the goals' rows (ours-model warm and the
    import baseline) until each ran ``REPEATS`` times: those rows report medians, their
    runs kept beside."""
    from _common import median

    workdir = tempfile.mkdtemp(prefix="warmstart-model-")
    caches = {
        "ours-model": tempfile.mkdtemp(prefix="wm-ours-model-"),
        "ours-backend": tempfile.mkdtemp(prefix="wm-ours-backend-"),
        "inductor": tempfile.mkdtemp(prefix="wm-inductor-"),
    }
    chosen = [row for row in ROWS if only is None or row in only]
    unknown = sorted(set(only or ()) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; the rows are {ROWS}")
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in chosen}
    order = chosen + [row for _ in range(REPEATS - 1) for row in REPEATED if row in chosen]
    for row in order:
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
            result = {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
        else:
            result = json.loads(out.stdout.strip().splitlines()[-1])
        runs[row].append(result)
        partial = os.environ.get("WARMSTART_PARTIAL")  # runs so far, for a run cut short
        if partial:
            with open(partial, "w", encoding="utf-8") as handle:
                json.dump(runs, handle, indent=1)
        shown = {k: v for k, v in result.items() if k not in ("serving_modules", "modules_before")}
        print(f"[warmstart] {row}: {shown}",
              flush=True)  # fmt: skip
    results: dict[str, Any] = {}
    for row, done in runs.items():
        good = [r for r in done if "error" not in r]
        if not good:
            results[row] = done[0]
            continue
        merged = dict(good[0])
        for field, value in good[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[field] = median([r[field] for r in good])
        if len(done) > 1:
            merged["runs"] = len(good)
            merged["all_runs"] = [
                {k: v for k, v in r.items() if k not in ("serving_modules", "modules_before")}
                for r in done
            ]
        results[row] = merged
    serving = results.get("ours-model warm", {})
    if "serving_modules" in serving:
        modules, before = serving.pop("serving_modules"), serving.pop("modules_before")
        beyond = [imports_beyond(before, modules) for _ in range(REPEATS)]
        serving["imports_beyond_torch_s"] = median(beyond)
        serving["serving_modules_added"] = len(modules)
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
        if "first_output_s" not in r:  # the import baseline
            rows.append([row, "-", "-", r["from_start_s"], "-", "-", "-"])
            continue
        rows.append(
            [row, r["first_output_s"], r["new_size_s"], r["from_start_s"], r["dynamo_frames"],
             r["inductor_compiles"], r["compiler_processes"]]
        )  # fmt: skip
    text = table(headers, rows)
    ours, base = document["rows"].get("ours-model warm", {}), document["rows"].get(BASELINE, {})
    if "error" not in ours and "from_start_s" in base and "from_start_s" in ours:
        budget = base["from_start_s"] + ours["model_built_s"] + 0.5
        text += (
            f"\n\ngoals (medians of {ours.get('runs', 1)}): serving imports beyond "
            f"import torch, transformers {ours.get('imports_beyond_torch_s', float('nan')):.3f} s "
            f"(<= 0.5); process start to first output {ours['from_start_s']:.2f} s (<= "
            f"{budget:.2f} = import torch, transformers {base['from_start_s']:.2f} + model built "
            f"{ours['model_built_s']:.2f} + 0.5); call to first output "
            f"{ours['first_output_s']:.3f} s (<= 0.3); compiler processes "
            f"{ours['compiler_processes']}; new size after warm-up {ours['new_size_s'] * 1000:.1f} "
            f"ms (<= 5); compiler modules imported {ours.get('compiler_modules')}"
        )
    return text


def plot(document: dict[str, Any], path: str) -> None:
    from _common import pyplot

    plt = pyplot()
    if plt is None:
        return
    rows = [(k, v) for k, v in document["rows"].items() if "first_output_s" in v]
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
