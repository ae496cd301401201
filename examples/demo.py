"""precompile demo: compile an MLP into several variants, save it, serve it from a fresh process.

    python examples/demo.py            # compile + save, then a fresh process loads and calls
    python examples/demo.py --serve D  # only the serving half, from a saved directory D

The serving process never compiles a graph: each call is dispatched to the variant
compiled nearest its batch size (or an exact-size variant), with guards checked.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import precompile

HINTS = [1, 16, 256]
EXACT_SIZES = [8]
CALL_SIZES = [1, 8, 5, 16, 100, 256, 1000, 3000]


class MLP(torch.nn.Module):
    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def capture(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph Dynamo hands a torch.compile backend, batch dim dynamic."""
    return precompile.capture_graph(model, x, dynamic={0: [0]})


def compile_and_save(directory: str) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 256)
    gm, example_inputs = capture(model, x)
    started = time.perf_counter()
    with torch.no_grad():
        art = precompile.standalone_compile(gm, example_inputs, hints=HINTS, sizes=EXACT_SIZES)
    elapsed = time.perf_counter() - started
    print(
        f"{len(art.variants)} variants ready in {elapsed:.1f} s (compiled, or read from the "
        f"cache at {precompile.default_cache().root}): {art}"
    )
    for variant in art.variants:
        print(
            f"  variant {variant.index}: {variant.kind:6s} {dict(variant.point)}  "
            f"guards {list(variant.guards)}"
        )
    art.save(path=os.path.join(directory, "mlp.pt2c"))
    # What the server feeds the graph besides x: the weights, by placeholder position.
    constants = {
        i: t.detach()
        for i, t in enumerate(example_inputs)
        if isinstance(t, torch.Tensor) and t is not x
    }
    torch.save(
        {"constants": constants, "state": model.state_dict()}, os.path.join(directory, "weights.pt")
    )
    print(
        f"saved {os.path.getsize(os.path.join(directory, 'mlp.pt2c')) / 1e3:.0f} kB "
        f"to {directory}/mlp.pt2c"
    )


def flat_inputs(
    art: precompile.CompiledArtifact, constants: dict[int, torch.Tensor], x: torch.Tensor
) -> list[Any]:
    """The graph's flat inputs: weights where they were, x, and SymInt sizes read from x."""
    args: list[Any] = [constants.get(i, x) for i in range(len(art.manifest.inputs))]
    for symbol in art.symbols:
        for source in symbol.sources:
            if source.dim is None:
                args[source.input_index] = int(x.shape[0])
    return args


def serve(directory: str) -> None:
    started = time.perf_counter()
    art = precompile.CompiledArtifact.load(path=os.path.join(directory, "mlp.pt2c"))
    saved = torch.load(os.path.join(directory, "weights.pt"))
    print(
        f"[server] loaded {art} in {(time.perf_counter() - started) * 1e3:.1f} ms "
        "(variants load on first use)"
    )
    reference = MLP().eval()
    reference.load_state_dict(saved["state"])
    print(
        f"[server] {'batch':>6} {'variant':>8} {'kind':>7} {'point':>8} {'decided by':>13} "
        f"{'ms':>9} {'max |err|':>10}"
    )
    for n in CALL_SIZES:
        x = torch.randn(n, 256)
        args = flat_inputs(art, saved["constants"], x)
        explanation = art.explain(*args)
        started = time.perf_counter()
        with torch.no_grad():
            out = art(*args)[0]
        elapsed = (time.perf_counter() - started) * 1e3
        with torch.no_grad():
            error = (out - reference(x)).abs().max().item()
        variant = art.variants[explanation.chosen or 0]
        point = ",".join(str(v) for v in variant.point.values())
        print(
            f"[server] {n:>6} {variant.index:>8} {variant.kind:>7} {point:>8} "
            f"{explanation.decided_by:>13} {elapsed:>9.2f} {error:>10.2e}"
        )
    print(
        "[server] first calls of a variant include loading it (kernels ship built: no compiler);"
        " repeats of a size run the memoized choice"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", metavar="DIR", help="only load and call a saved artifact")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.serve:
        serve(args.serve)
        return
    with tempfile.TemporaryDirectory(prefix="precompile-demo-") as directory:
        compile_and_save(directory)
        print("starting a fresh process to serve it ...")
        subprocess.run([sys.executable, __file__, "--serve", directory], check=True)


if __name__ == "__main__":
    main()
