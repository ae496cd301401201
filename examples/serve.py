"""A small HTTP model server that warm-starts a whole compiled model.

    python examples/serve.py --build        # compile the demo MLP (compile_model), save it
    python examples/serve.py                # serve it on http://127.0.0.1:8765
    python examples/serve.py --demo         # build if needed, start a server process,
                                            # send requests of varying batch size, stop

The build step runs ``precompile.compile_model`` once (it traces the model and compiles
its variants, or finds them in the cache without tracing) and saves the compiled model
as one file beside the weights. The server builds the model, loads its weights, and binds
the saved file to it with ``precompile.load_model``: no Dynamo frame, no compile, no gcc
(the built kernels are in the file). Variants warm up in the background while it answers
``POST /infer`` with ``{"batch": n}`` (a seeded random input of n rows) or
``{"x": [[...256 floats], ...]}``; each answer says which variant served it and why.
``GET /health`` reports time-to-ready and the loaded variants.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STARTED = time.perf_counter()
import torch  # noqa: E402

TORCH_IMPORTED = time.perf_counter()
import precompile  # noqa: E402

PRECOMPILE_IMPORTED = time.perf_counter()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import EXACT_SIZES, HINTS, MLP  # noqa: E402

WIDTH = 256
DEFAULT_PORT = 8765
DEFAULT_MODEL_DIR = os.path.join(tempfile.gettempdir(), "precompile-demo-model")
DEMO_BATCHES = [1, 8, 5, 16, 100, 256, 1000, 3000, 5]


def build(model_dir: str) -> None:
    """The build step: compile the model (or find it in the cache) and save it beside its
    weights, as one shippable file."""
    torch.manual_seed(0)
    model = MLP().eval()
    started = time.perf_counter()
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randn(4, WIDTH),), dynamic={0: [0]}, hints=HINTS, sizes=EXACT_SIZES,
            warmup=False,
        )  # fmt: skip
    os.makedirs(model_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(model_dir, "weights.pt"))
    compiled.save(os.path.join(model_dir, "mlp.pt2c"))
    print(
        f"[build] {compiled.artifact} ready in {time.perf_counter() - started:.1f} s "
        f"(cache {precompile.default_cache().root}); saved to {model_dir}"
    )


class Model:
    """The served model: the demo MLP with its weights, bound to the saved compiled file."""

    def __init__(self, model_dir: str) -> None:
        began = time.perf_counter()
        model = MLP().eval()
        model.load_state_dict(torch.load(os.path.join(model_dir, "weights.pt")))
        path = os.path.join(model_dir, "mlp.pt2c")
        if not os.path.exists(path):
            raise SystemExit(f"no compiled model at {path}: run --build first")
        self.compiled = precompile.load_model(model, path=path, warmup="background")
        self.loaded_s = time.perf_counter() - began

    def infer(self, x: torch.Tensor) -> dict[str, Any]:
        explanation = self.compiled.explain(x)
        began = time.perf_counter()
        with torch.no_grad():
            out = self.compiled(x)
        elapsed = time.perf_counter() - began
        variant = self.compiled.artifact.variants[explanation.chosen or 0]
        return {
            "rows": int(out.shape[0]),
            "variant": variant.index,
            "kind": variant.kind,
            "point": dict(variant.point),
            "decided_by": explanation.decided_by,
            "ms": round(elapsed * 1e3, 3),
            "checksum": float(out.double().sum()),
        }


def make_handler(model: Model, timings: dict[str, float]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._reply(404, {"error": f"no route {self.path}"})
                return
            art = model.compiled.artifact
            body = {
                **timings,
                "loaded_variants": list(art.loaded_variants),
                "variants": len(art.variants),
            }
            self._reply(200, body)

        def do_POST(self) -> None:
            if self.path != "/infer":
                self._reply(404, {"error": f"no route {self.path}"})
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if "x" in request:
                    x = torch.tensor(request["x"], dtype=torch.float32)
                else:
                    batch = int(request["batch"])
                    if not 1 <= batch <= 65536:
                        raise ValueError(f"batch must be in 1..65536, got {batch}")
                    generator = torch.Generator().manual_seed(int(request.get("seed", 0)))
                    x = torch.randn(batch, WIDTH, generator=generator)
                if x.dim() != 2 or x.shape[1] != WIDTH:
                    raise ValueError(f"x must be (rows, {WIDTH}), got {tuple(x.shape)}")
            except (ValueError, KeyError, TypeError) as exc:
                self._reply(400, {"error": str(exc)})
                return
            try:
                self._reply(200, model.infer(x))
            except precompile.PrecompileError as exc:
                self._reply(422, {"error": f"{type(exc).__name__}: {exc}"})

        def log_message(self, format: str, *args: Any) -> None:
            logging.getLogger("precompile.examples.serve").debug(format, *args)

    return Handler


def serve(port: int, model_dir: str) -> None:
    model = Model(model_dir)
    timings = {
        "import_torch_s": round(TORCH_IMPORTED - STARTED, 3),
        "import_precompile_s": round(PRECOMPILE_IMPORTED - TORCH_IMPORTED, 3),
        "load_s": round(model.loaded_s, 4),
        "ready_s": round(time.perf_counter() - STARTED, 3),
    }
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(model, timings))
    print(
        f"[server] ready on http://127.0.0.1:{port} {timings['ready_s']:.2f} s after start "
        f"(import torch {timings['import_torch_s']:.2f} s, import precompile "
        f"{timings['import_precompile_s']:.2f} s, load {timings['load_s'] * 1e3:.1f} ms); "
        f"{model.compiled.artifact}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


def _request(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(url, data=data, timeout=60) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def demo(port: int, model_dir: str) -> None:
    """Build if needed, start a server process, send it requests, stop it."""
    build(model_dir)  # a cache hit when it was built before: no tracing, no compile
    command = [sys.executable, __file__, "--port", str(port), "--model-dir", model_dir]
    began = time.perf_counter()
    server = subprocess.Popen(command)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            try:
                health = _request(f"{base}/health")
                break
            except OSError:
                if server.poll() is not None or time.perf_counter() - began > 120:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.05)
        print(f"[client] server answered /health {time.perf_counter() - began:.2f} s after spawn")
        print(
            f"[client] {'batch':>6} {'variant':>8} {'kind':>7} {'point':>10} {'decided by':>13} "
            f"{'ms':>8}"
        )
        for batch in DEMO_BATCHES:
            reply = _request(f"{base}/infer", {"batch": batch, "seed": batch})
            point = ",".join(str(v) for v in reply["point"].values())
            print(
                f"[client] {batch:>6} {reply['variant']:>8} {reply['kind']:>7} {point:>10} "
                f"{reply['decided_by']:>13} {reply['ms']:>8.2f}"
            )
        health = _request(f"{base}/health")
        print(f"[client] /health: {health}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--build", action="store_true", help="compile into the cache and tag it")
    parser.add_argument("--demo", action="store_true", help="build if needed, serve, send requests")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="where the weights live")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.build:
        build(args.model_dir)
    elif args.demo:
        demo(args.port, args.model_dir)
    else:
        serve(args.port, args.model_dir)


if __name__ == "__main__":
    main()
