"""Where a GPU build's GEMM autotuning goes (results/build-autotune-<device>.json).

    python benchmarks/_autotune_diag.py [--layers 4] [--torch-default]

Runs ``benchmarks/build.py``'s ``compile_model`` row in this process, with empty inductor,
Triton and precompile caches, and times every ``triton.compile``, every Triton kernel's
precompile, and every timing of a GEMM template choice, by the thread that ran it (a call
over 0.05 s counts as slow: it compiled). ``--torch-default`` leaves template choices to
inductor's compile workers, as torch does, instead of ``compile_model``'s threads.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

Key = tuple[str, str, str]


# who asked for each slow compile on the main thread: the build's phase, then the innermost
# inductor frame outside the kernel runtime (select_algorithm's timing, the wrapper's
# compile-time autotuning, ...), with the count and the seconds they took
callers: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
phase = ["other"]


def _phase(owner: Any, name: str, label: str) -> None:
    """While ``owner.name`` runs, the main thread's slow compiles count under ``label``."""
    original: Callable[..., Any] = getattr(owner, name)

    def labelled(*args: Any, **kwargs: Any) -> Any:
        outer, phase[0] = phase[0], label
        try:
            return original(*args, **kwargs)
        finally:
            phase[0] = outer

    setattr(owner, name, labelled)


def _inductor_caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace(os.sep, "/")
        if "torch/_inductor/" in path and "/runtime/" not in path:
            return f"{path.split('torch/_inductor/')[1]}:{frame.name}"
    return "outside inductor"


def _timed(owner: Any, name: str, label: str, stats: dict[Key, list[float]]) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            took = time.perf_counter() - started
            thread = threading.current_thread().name.split("_")[0]
            entry = stats[(label, thread, "slow" if took > 0.05 else "fast")]
            entry[0] += 1
            entry[1] += took
            if label == "triton.compile" and took > 0.05 and thread == "MainThread":
                entry = callers[f"{phase[0]}: {_inductor_caller()}"]
                entry[0] += 1
                entry[1] += took

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--torch-default", action="store_true")
    parser.add_argument("--out", help="the result file (default: benchmarks/results/)")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="autotune-diag-")
    for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                      ("PRECOMPILE_CACHE_DIR", "precompile")):  # fmt: skip
        os.environ[name] = os.path.join(scratch, sub)
    import triton
    import triton.compiler.compiler as triton_compiler
    from torch._inductor import select_algorithm
    from torch._inductor.runtime import triton_heuristics

    from precompile import _standalone, _torch_adapter, _variant_compile

    stats: dict[Key, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    _timed(triton_compiler, "compile", "triton.compile", stats)
    triton.compile = triton_compiler.compile
    _timed(triton_heuristics.CachingAutotuner, "precompile", "kernel precompile", stats)
    _timed(select_algorithm.TritonTemplateCaller, "benchmark", "template timing", stats)
    _phase(_variant_compile, "compile_variant", "variant compile")
    _phase(_standalone, "_complete_gpu_leans", "launch recording")
    if args.torch_default:
        _torch_adapter.precompiling_templates_in_threads = contextlib.nullcontext  # type: ignore[assignment]
    import build
    from _common import RESULTS, device_slug, environment

    result = build.child("compile_model", args.layers, "cuda")
    env = environment("cuda")
    path = args.out or os.path.join(RESULTS, f"build-autotune-{device_slug('cuda', env)}.json")
    document: dict[str, Any] = {"environment": env, "runs": {}}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            document["runs"] = json.load(handle).get("runs", {})
    setting = "torch default (compile workers)" if args.torch_default else "compile_model"
    document["runs"][f"{setting}, {args.layers} layers"] = {
        **result,
        "calls": {
            " | ".join(k): {"count": int(v[0]), "seconds": round(v[1], 2)}
            for k, v in sorted(stats.items())
        },
        "slow main-thread compiles by phase and caller": {
            k: {"count": int(v[0]), "seconds": round(v[1], 2)}
            for k, v in sorted(callers.items(), key=lambda item: -item[1][1])
        },
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    print(json.dumps(document["runs"][f"{setting}, {args.layers} layers"], indent=1))


if __name__ == "__main__":
    main()
