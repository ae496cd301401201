"""Cold compile vs warm start, ours vs upstream, each in a fresh process with an empty
inductor cache: import, load, first output, and how many processes (compilers) started.

    python benchmarks/warmstart.py                 # CPU, 3 fresh processes per row
    python benchmarks/warmstart.py --device cuda   # on a GPU machine
    python benchmarks/warmstart.py --model [--device cuda]   # a Llama: see _warmstart_model

Rows: ``ours cold`` (trace + compile every variant + first call), ``ours warm``
(``CompiledArtifact.load`` of our saved artifact + first call), ``upstream cold``
(``torch._inductor.standalone_compile``, one variant), ``upstream warm`` (upstream
``CompiledArtifact.load`` + first call). The graph is the demo MLP (256 -> 1024 -> 256,
dynamic batch); the first request has batch 5. Medians over ``--repeats`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

ROWS = ["ours cold", "ours warm", "upstream cold", "upstream warm"]
FIRST_BATCH = 5


# -- the child process: one measurement ---------------------------------------------------
def _child(mode: str, workdir: str, device: str) -> dict[str, Any]:
    from _common import is_compiler, watch_processes

    started = time.perf_counter()
    spawned = watch_processes()
    import torch

    torch_imported = time.perf_counter()
    if mode.startswith("ours"):
        import precompile
    else:
        import torch._inductor.standalone_compile
    lib_imported = time.perf_counter()

    from demo import MLP, capture

    if mode == "build":
        return _build(workdir, device)
    layout = torch.load(os.path.join(workdir, "layout.pt"))
    x = torch.randn(FIRST_BATCH, 256, device=device)
    args: list[Any] = []
    for index in range(layout["inputs"]):
        if index in layout["constants"]:
            args.append(layout["constants"][index].to(device))
        elif index in layout["sizes"]:
            args.append(FIRST_BATCH)
        else:
            args.append(x)

    load_s = 0.0
    if mode.endswith("cold"):
        torch.manual_seed(0)
        model = MLP().eval().to(device)
        gm, example_inputs = capture(model, torch.randn(4, 256, device=device))
        if mode == "ours cold":
            from demo import EXACT_SIZES, HINTS

            import precompile

            with torch.no_grad():
                art = precompile.standalone_compile(
                    gm, example_inputs, hints=HINTS, sizes=EXACT_SIZES, cache=False
                )
        else:
            from torch._inductor import standalone_compile

            art = standalone_compile(gm, example_inputs)
    else:
        began = time.perf_counter()
        if mode == "ours warm":
            import precompile

            art = precompile.CompiledArtifact.load(path=os.path.join(workdir, "ours.pt2c"))
        else:
            from torch._inductor import CompiledArtifact

            art = CompiledArtifact.load(path=os.path.join(workdir, "upstream.bin"))
        load_s = time.perf_counter() - began
    call_began = time.perf_counter()
    with torch.no_grad():
        out = art(*args)
        out = out[0] if isinstance(out, (list, tuple)) else out
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    done = time.perf_counter()
    error = float((out.float() - _reference(layout["state"], x)).abs().max())
    compilers = [p for p in spawned if is_compiler(p)]
    return {
        "import_torch_s": torch_imported - started,
        "import_library_s": lib_imported - torch_imported,
        "load_s": load_s,
        "first_call_s": done - call_began,
        "first_output_after_import_s": done - lib_imported,
        "from_start_s": done - started,
        "processes": len(spawned),
        "compiler_processes": len(compilers),
        "max_abs_error": error,
    }


def _build(workdir: str, device: str) -> dict[str, Any]:
    import torch
    from demo import EXACT_SIZES, HINTS, MLP, capture
    from torch._inductor import standalone_compile

    import precompile

    torch.manual_seed(0)
    model = MLP().eval().to(device)
    x = torch.randn(4, 256, device=device)
    gm, example_inputs = capture(model, x)
    with torch.no_grad():
        ours = precompile.standalone_compile(
            gm, example_inputs, hints=HINTS, sizes=EXACT_SIZES, cache=False
        )
    ours.save(path=os.path.join(workdir, "ours.pt2c"))
    upstream = standalone_compile(gm, example_inputs)
    upstream.save(path=os.path.join(workdir, "upstream.bin"), format="binary")
    layout = {
        "inputs": len(example_inputs),
        "constants": {
            i: t.detach().cpu()
            for i, t in enumerate(example_inputs)
            if isinstance(t, torch.Tensor) and t is not x
        },
        "sizes": [i for i, t in enumerate(example_inputs) if isinstance(t, torch.SymInt)],
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
    }
    torch.save(layout, os.path.join(workdir, "layout.pt"))
    return {
        "ours_bytes": os.path.getsize(os.path.join(workdir, "ours.pt2c")),
        "upstream_bytes": os.path.getsize(os.path.join(workdir, "upstream.bin")),
        "ours_variants": len(ours.variants),
    }


def _reference(state: dict[str, Any], x: Any) -> Any:
    """Eager MLP with the build's weights, on x's device."""
    import torch
    from demo import MLP

    model = MLP().eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model.to(x.device)(x).float()


# -- the parent: orchestrate fresh processes ---------------------------------------------
def _run(mode: str, workdir: str, device: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="warmstart-inductor-"),
        "PRECOMPILE_CACHE_DIR": tempfile.mkdtemp(prefix="warmstart-cache-"),
        "PRECOMPILE_BUILD_DIR": "",
    }
    env.pop("TRITON_CACHE_DIR", None)
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="warmstart-triton-")
    command = [sys.executable, __file__, "--child", mode, "--workdir", workdir, "--device", device]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", metavar="JSON", help="only redraw the plot of a result file")
    parser.add_argument(
        "--model", action="store_true", help="the model level: a Llama, compile_model and rivals"
    )
    parser.add_argument(
        "--rows",
        help="with --model: only these rows (separated by ';'); the other rows are kept from "
        "the result file and listed in its rows_from_earlier_run",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.workdir, args.device)))
        return
    if args.model_child:
        import _warmstart_model

        print(json.dumps(_warmstart_model.child(args.model_child, args.workdir, args.device)))
        return
    if args.model:
        _model_level(args.device, args.rows.split(";") if args.rows else None)
        return
    if args.plot:
        with open(args.plot, encoding="utf-8") as handle:
            plot(json.load(handle), os.path.basename(args.plot).replace(".json", ".png"))
        return

    from _common import environment, median, table, write_json

    workdir = tempfile.mkdtemp(prefix="warmstart-")
    print(f"building both artifacts in {workdir} ...", flush=True)
    built = _run("build", workdir, args.device)
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    for repeat in range(args.repeats):
        for row in ROWS:  # interleaved, so drift hits every row alike
            runs[row].append(_run(row, workdir, args.device))
            print(
                f"  repeat {repeat + 1}/{args.repeats} {row}: "
                f"{runs[row][-1]['first_output_after_import_s']:.3f} s",
                flush=True,
            )
    fields = [
        "import_torch_s",
        "import_library_s",
        "load_s",
        "first_call_s",
        "first_output_after_import_s",
        "from_start_s",
        "processes",
        "compiler_processes",
        "max_abs_error",
    ]
    summary = {row: {f: median([r[f] for r in runs[row]]) for f in fields} for row in ROWS}
    headers = [
        "row",
        "import torch s",
        "import lib s",
        "load s",
        "first call s",
        "first output after import s",
        "from start s",
        "processes",
        "compilers",
        "max err",
    ]
    print()
    print(table(headers, [[row, *(summary[row][f] for f in fields)] for row in ROWS]))
    ours, theirs = summary["ours warm"], summary["upstream warm"]
    print(
        f"\nwarm start: first output {ours['first_output_after_import_s']:.3f} s after import "
        f"(upstream {theirs['first_output_after_import_s']:.3f} s); from process start "
        f"{ours['from_start_s']:.2f} s vs {theirs['from_start_s']:.2f} s "
        f"({theirs['from_start_s'] / ours['from_start_s']:.1f}x). Our import includes the "
        "torch compiler modules that upstream imports during its load."
    )
    document = {
        **environment(args.device),
        "repeats": args.repeats,
        "build": built,
        "median": summary,
        "runs": runs,
    }
    name = "warmstart-cuda.json" if args.device.startswith("cuda") else "warmstart-cpu.json"
    print(f"wrote {write_json(name, document)}")
    plot(document, name.replace(".json", ".png"))


def _model_level(device: str, only: list[str] | None) -> None:
    import _warmstart_model as model_level

    from _common import RESULTS, environment, write_json

    name = f"warmstart-model-{'cuda' if device.startswith('cuda') else 'cpu'}.json"
    document = {**environment(device), "rows": model_level.run_all(device, only)}
    if only:
        with open(os.path.join(RESULTS, name), encoding="utf-8") as handle:
            earlier = json.load(handle)
        kept = {row: r for row, r in earlier["rows"].items() if row not in document["rows"]}
        merged = {**kept, **document["rows"]}
        document["rows"] = {row: merged[row] for row in model_level.ROWS if row in merged}
        document["rows_from_earlier_run"] = sorted(kept)
    print(model_level.report(document))
    print(f"wrote {write_json(name, document)}")
    model_level.plot(document, os.path.join(RESULTS, name.replace(".json", ".png")))


def plot(document: dict[str, Any], name: str) -> None:
    """Stacked bars: where each row's time from process start to first output goes."""
    from _common import RESULTS, median, pyplot

    plt = pyplot()
    if plt is None:
        return
    phases = [
        ("import torch", "import_torch_s"),
        ("import library", "import_library_s"),
        ("load", "load_s"),
        ("compile + first call / first call", None),
    ]
    figure, axis = plt.subplots(figsize=(8, 3.6))
    for row_number, row in enumerate(ROWS):
        values = {
            field: median([run[field] for run in document["runs"][row]])
            for field in document["runs"][row][0]
        }
        left = 0.0
        for color, (label, field) in enumerate(phases):
            width = values["from_start_s"] - left if field is None else values[field]
            axis.barh(
                row_number,
                width,
                left=left,
                color=f"C{color}",
                label=label if row_number == 0 else None,
            )
            left += width
        axis.text(left, row_number, f" {left:.2f} s", va="center")
    axis.set_yticks(range(len(ROWS)), ROWS)
    axis.invert_yaxis()
    axis.set_xlabel("seconds from process start to first output (median)")
    axis.set_title(f"Warm start on {document['device']} (torch {document['torch']})")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8)
    figure.tight_layout()
    path = os.path.join(RESULTS, name)
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
