"""Shared plumbing of the benchmark scripts: result files, tables, medians, plots."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(0))
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


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
