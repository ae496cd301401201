"""Shared plumbing of the benchmark scripts: result files, tables, medians, plots."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(0))
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def device_slug(device: str, env: dict[str, Any]) -> str:
    """The short name of ``device`` in result file names ("cpu", "h200"), from
    ``environment(device)``'s description of it."""
    if device == "cpu":
        return "cpu"
    chip = re.search(r"\b([A-Z]\d{2,3})\b", str(env["device"]))
    return chip[1].lower() if chip else "gpu"


def environment(device: str) -> dict[str, Any]:
    import torch

    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv,
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rotating(fn: Callable[..., Any], argument_sets: Sequence[Sequence[Any]]) -> Callable[[], Any]:
    """A zero-argument call of ``fn`` that takes the next argument set each time, so
    repeated calls do not read inputs left warm in cache by the call before."""
    position = [0]

    def call() -> Any:
        position[0] = (position[0] + 1) % len(argument_sets)
        return fn(*argument_sets[position[0]])

    return call


def write_json(name: str, document: dict[str, Any]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    return path


def gpu_waits(run: Callable[[], object]) -> list[tuple[str, int]]:
    """Where ``run`` waited for the GPU (file, line), one entry per wait: torch's sync
    debug mode, as warnings. Shared by the decode benchmark's profile and the GPU tests'
    no-sync checks."""
    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [(w.filename, w.lineno) for w in caught
            if "synchronizing CUDA operation" in str(w.message)]  # fmt: skip


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (what the README shows), columns padded for the terminal."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def pyplot() -> Any | None:
    """matplotlib's pyplot (headless), or None with a note when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install -e '.[bench]' for matplotlib)")
        return None
    return plt


def result_figure(path: str, figsize: tuple[float, float]) -> tuple[Any, Any, Any, Any] | None:
    """pyplot, the result document at ``path`` and a new figure and axis to plot it on;
    None when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    figure, axis = plt.subplots(figsize=figsize)
    return plt, document, figure, axis


def count_tracing_and_compiles() -> tuple[list[int], list[int]]:
    """Lists that grow by one per Dynamo frame traced and per inductor compile, from now
    on in this process (patches torch's entry points; for benchmark children only)."""
    import torch._inductor.compile_fx as compile_fx
    from torch._dynamo import convert_frame

    frames: list[int] = []
    compiles: list[int] = []
    original_frame, original_compile = convert_frame._compile, compile_fx.compile_fx
    convert_frame._compile = lambda *a, **k: (frames.append(1), original_frame(*a, **k))[1]
    compile_fx.compile_fx = lambda *a, **k: (compiles.append(1), original_compile(*a, **k))[1]
    return frames, compiles


COMPILERS = ("gcc", "g++", "cc", "c++", "clang", "clang++", "ptxas", "nvcc", "ld", "as",
             "cc1", "cc1plus")  # fmt: skip


def watch_processes() -> list[str]:
    """A list that gets the name of every program this process starts from now on (an
    audit hook: subprocess, posix_spawn, exec, system)."""
    import sys

    spawned: list[str] = []

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event == "subprocess.Popen":
            argv = args[1] if isinstance(args[1], (list, tuple)) else [args[0] or args[1]]
            spawned.append(os.path.basename(str(argv[0])))
        elif event in ("os.posix_spawn", "os.exec", "os.system"):
            spawned.append(os.path.basename(str(args[0])))

    sys.addaudithook(audit)
    return spawned


def is_compiler(program: str) -> bool:
    """gcc, ptxas and friends, also under versioned names (``gcc-12``)."""
    return program.split("-")[0] in COMPILERS or "ptxas" in program


def llama(
    size: str, device: str, dtype: Any, max_positions: int = 4096, layers: int | None = None
) -> Any:
    """The benchmarks' random-initialized ``transformers`` Llama: ``"tiny"`` (2 layers,
    hidden 64, vocab 512) or ``"issue"`` (4 layers, hidden 2048, vocab 32000, the model
    of the serving issue), built on ``device`` (random init there: seconds less);
    ``layers`` instead of its own depth."""
    import torch
    import transformers

    torch.manual_seed(0)
    if size == "tiny":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2,
            num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=max_positions,
            use_cache=False,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers or 4,
            num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=max_positions,
            use_cache=False,
        )  # fmt: skip
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype=dtype).eval()
