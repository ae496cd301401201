"""A fresh serving process for ``test_gpu_lean.py``: runs one job, saves its outputs and
prints what it imported of torch's compiler as JSON (its last line).

    python tests/gpu_lean_child.py artifact PATH CASES OUT
    python tests/gpu_lean_child.py llama CACHE CUDAGRAPHS OUT
    python tests/gpu_lean_child.py decode CACHE CUDAGRAPHS OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

started = time.perf_counter()
import torch  # noqa: E402

imported_torch = time.perf_counter()
import precompile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILER = ("torch._inductor", "triton.compiler")  # (torch imports some of functorch itself)


BEFORE: set[str] = set()  # what the process held before its serving began


def compiler_modules() -> list[str]:
    """The compiler modules serving imported (transformers imports some itself, with the
    model: those are not ours)."""
    return sorted(m for m in list(sys.modules) if m.startswith(COMPILER) and m not in BEFORE)


def artifact(path: str, cases: str, out: str) -> dict[str, object]:
    art = precompile.CompiledArtifact.load(path=path)
    loaded = time.perf_counter()
    inputs = torch.load(cases)
    with torch.no_grad():
        outputs = [[o.clone() for o in art(*flat)] for flat in inputs]
    torch.cuda.synchronize()
    torch.save(outputs, out)
    return {"load_s": loaded - imported_torch, "dynamo": "torch._dynamo" in sys.modules}


def llama(cache: str, cudagraphs: str, out: str) -> dict[str, object]:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
    from _common import llama as build

    model = build("issue", "cuda", torch.bfloat16)
    BEFORE.update(sys.modules)
    torch.manual_seed(2)
    outputs = {}
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randint(0, 32000, (1, 128), device="cuda"),), dynamic={0: [1]},
            hints=[16, 256], cache=cache, compile=False, cudagraphs=cudagraphs == "1",
            warmup=False,
        )  # fmt: skip
        for size in (128, 1, 7, 200, 128, 1):
            ids = torch.randint(0, 32000, (1, size), device="cuda")
            outputs[len(outputs)] = compiled(ids).logits.clone()
    torch.cuda.synchronize()
    torch.save(outputs, out)
    return {}


def decode(cache: str, cudagraphs: str, out: str) -> dict[str, object]:
    sys.path.insert(0, HERE)
    from decode_helpers import VOCAB, build, greedy, new_cache

    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    BEFORE.update(sys.modules)
    call = {"input_ids": torch.randint(0, VOCAB, (2, 7), device="cuda"),
            "past_key_values": new_cache(model), "use_cache": True}  # fmt: skip
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (), call, dynamic={"input_ids": [0, 1]},
            hints={("input_ids", 0): [1, 8], ("input_ids", 1): [1, 8]}, sizes=[],
            cache=cache, compile=False, cudagraphs=cudagraphs == "1", warmup=False,
        )  # fmt: skip
    torch.manual_seed(6)
    tokens = [greedy(compiled, model, torch.randint(0, VOCAB, (b, 7), device="cuda"))
              for b in (1, 3)]  # fmt: skip
    torch.save(tokens, out)
    return {}


if __name__ == "__main__":
    job, *arguments = sys.argv[1:]
    result = {"artifact": artifact, "llama": llama, "decode": decode}[job](*arguments)
    result.update(
        compiler_modules=compiler_modules(),
        import_precompile_s=time.perf_counter() - imported_torch,
        lean=os.environ.get("PRECOMPILE_LEAN", "1") != "0",
    )
    print(json.dumps(result))
