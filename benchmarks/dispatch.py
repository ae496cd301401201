"""Host time our runtime adds per call on the memoized path (CPU, one process).

    python benchmarks/dispatch.py

For each graph, times ``art(*args)`` (read the sizes, check the inputs, look the variant
up in the memo, call it) against calling the chosen variant's callable directly with
the same arguments, interleaved in one run, and reports the median difference per call.
The last column runs the same runtime over a no-op variant: the overhead alone, free
of the noise of the kernel's own run time (which swamps it for the larger graph).
Graphs: a 1-input elementwise graph (the least work per call) and the demo MLP's graph
(8 flat inputs: weights and activations), at a few sizes each.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import torch  # noqa: E402

import precompile  # noqa: E402
from runtime._payloads import MemoryPayloads  # noqa: E402

ROUND_S = 0.05  # each timed round runs about this long
ROUNDS = 15


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def capture(model: torch.nn.Module, x: torch.Tensor) -> tuple[Any, list[Any]]:
    box: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        box["gm"], box["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(x)
    return box["gm"], box["inputs"]


def _noop(*args: Any) -> None:
    return None


def per_call_ns(fn: Callable[..., Any], args: list[Any], calls: int) -> float:
    began = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter_ns() - began) / calls


def calls_per_round(fn: Callable[..., Any], args: list[Any]) -> int:
    return max(100, int(ROUND_S * 1e9 / per_call_ns(fn, args, 100)))


def measure(name: str, model: torch.nn.Module, width: int, sizes: list[int]) -> list[list[Any]]:
    x = torch.randn(4, width)
    gm, example_inputs = capture(model, x)
    with torch.no_grad():
        art = precompile.standalone_compile(gm, example_inputs, hints=[16, 256], cache=False)
    rows = []
    for n in sizes:
        xn = torch.randn(n, width)
        args = [xn if t is x else (n if isinstance(t, torch.SymInt) else t) for t in example_inputs]
        direct = art.variant_callable(art.variant_for(*args))
        with torch.no_grad():
            art(*args)  # memoize the choice, load the variant
            calls = calls_per_round(direct, args)
            ours, theirs = [], []
            for _ in range(ROUNDS):  # interleaved rounds: drift hits both sides alike
                ours.append(per_call_ns(art, args, calls))
                theirs.append(per_call_ns(direct, args, calls))
        added = [a - b for a, b in zip(ours, theirs, strict=True)]
        # The same runtime over a variant that does nothing: its cost alone, without the
        # noise of a real kernel's run time.
        noop = _noop
        hollow = precompile.CompiledArtifact(
            art.manifest,
            MemoryPayloads({}),
            loaded={digest: noop for digest in art.manifest.graph_digests},
        )
        hollow(*args)
        isolated = []
        calls = calls_per_round(hollow, args)
        for _ in range(ROUNDS):
            isolated.append(per_call_ns(hollow, args, calls) - per_call_ns(noop, args, calls))
        rows.append(
            [
                name,
                len(example_inputs),
                n,
                statistics.median(theirs) / 1e3,
                statistics.median(ours) / 1e3,
                statistics.median(added) / 1e3,
                statistics.median(isolated) / 1e3,
            ]
        )
    return rows


def main() -> None:
    from _common import environment, table, write_json
    from demo import MLP

    torch.manual_seed(0)
    rows = measure("x + 1", Tiny(), 8, [4, 64])
    rows += measure("demo MLP", MLP().eval(), 256, [4, 64])
    headers = [
        "graph",
        "flat inputs",
        "M",
        "variant direct us",
        "art(*args) us",
        "added us",
        "added us (no-op variant)",
    ]
    print(table(headers, rows))
    document = {
        **environment("cpu"),
        "seconds_per_round": ROUND_S,
        "rounds": ROUNDS,
        "rows": [dict(zip(headers, row, strict=True)) for row in rows],
    }
    print(f"wrote {write_json('dispatch-cpu.json', document)}")


if __name__ == "__main__":
    main()
