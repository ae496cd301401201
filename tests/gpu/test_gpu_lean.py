"""The GPU lean path (``pytest -m gpu``): a serving process loads GPU variants and launches
their Triton kernels from the shipped binaries, importing neither inductor nor Triton's
compiler, with outputs bitwise equal to upstream's path where both run the same kernels.

Each serving process is fresh (``gpu_lean_child.py``), once on the lean path and once
with ``PRECOMPILE_LEAN=0`` (upstream's deserializer, which re-autotunes kernels of several
configs in the serving process: there the two may pick other configs, and outputs are
compared to the build's own run instead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import ROOT, capture

import precompile

pytestmark = pytest.mark.gpu
CHILD = os.path.join(ROOT, "tests", "gpu_lean_child.py")
SIZES = (1, 3, 5, 16, 100, 300)


def build_configs() -> str:
    """What this (building) process's compiler configs hold besides their defaults, and
    the variables of theirs set: what a serving process's lookup key must agree with."""
    from precompile import _compiler_config as config
    from precompile import _torch_adapter as adapter

    changed = {n: config._non_defaults(sys.modules[n]) for n in adapter.CONFIG_MODULES
               if n in sys.modules}  # fmt: skip
    return f"build configs: {changed}, environment: {config._config_environment()}"


def child(*arguments: str, lean: bool = True) -> dict[str, Any]:
    env = {**os.environ, "PRECOMPILE_LEAN": "1" if lean else "0"}
    done = subprocess.run([sys.executable, CHILD, *arguments], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + "\n" + build_configs()
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def lean_and_upstream(job: str, cache: str, cudagraphs: str, folder: Any) -> tuple[Any, Any]:
    """The outputs of ``job`` served by two fresh processes: on the lean path (which must
    import no compiler module beyond what the model's own library did) and upstream's."""
    lean_out, upstream_out = str(folder / "lean.pt"), str(folder / "upstream.pt")
    lean = child(job, cache, cudagraphs, lean_out)
    assert lean["compiler_modules"] == [], lean
    child(job, cache, cudagraphs, upstream_out, lean=False)
    return torch.load(lean_out), torch.load(upstream_out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


class Reductions(torch.nn.Module):
    """An extern mm, a persistent reduction (layer_norm, softmax) and a looped one (amax
    over the dynamic dim): kernels of several configs, autotuned at build time."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 128)
        self.norm = torch.nn.LayerNorm(128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.norm(torch.relu(self.linear(x)))
        return torch.softmax(y, -1) * y.sum(-1, keepdim=True), y.amax(0)


class ExternOutput(torch.nn.Module):
    """An extern kernel's output returned as it is, beside a pointwise kernel's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 96))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.weight
        return y, torch.relu(y) * 2 + 1


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder = tmp_path_factory.mktemp("gpu-lean")
    result: dict[str, Any] = {}
    for name, cls in (("reductions", Reductions), ("extern", ExternOutput)):
        torch.manual_seed(0)
        model = cls().cuda().eval()
        captured = capture(model, torch.randn(5, 64, device="cuda"))
        with torch.no_grad():
            art = precompile.standalone_compile(
                captured.gm, captured.example_inputs, hints=[16, 256], sizes=[3]
            )
            xs = [torch.randn(n, 64, device="cuda") for n in SIZES]
            inputs = [captured.flat(x) for x in xs]
            outputs = [[o.clone() for o in art(*flat)] for flat in inputs]
            eager = [model(x) for x in xs]
        path, cases = str(folder / f"{name}.pt2c"), str(folder / f"{name}-cases.pt")
        art.save(path=path)
        torch.save(inputs, cases)
        result[name] = dict(art=art, path=path, cases=cases, outputs=outputs, model=model,
                            eager=eager, folder=folder)  # fmt: skip
    return result


@pytest.mark.parametrize("name", ["reductions", "extern"])
def test_every_gpu_variant_is_lean(built: dict[str, Any], name: str) -> None:
    manifest = built[name]["art"].manifest
    for variant in manifest.variants:
        assert variant.lean is not None, variant
        assert variant.lean.triton, variant  # Triton kernels launched from their binaries
        assert variant.lean.align  # inputs realigned as inductor's wrapper does
    assert manifest.triton_digests  # the binaries ship with the artifact
    for got, want in zip(built[name]["outputs"], built[name]["eager"], strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hint_variants_take_triton_gemms_and_exact_sizes_cublas(built: dict[str, Any]) -> None:
    """The GEMM policy (``precompile._gemm_policy``): a hint variant serves every size, so
    its GEMMs are Triton templates (no per-shape cuBLAS planning at a new size); the
    exact-size variant keeps cuBLAS, planned in the warm-up."""
    variants = built["extern"]["art"].manifest.variants
    assert {v.kind for v in variants} == {"hint", "static"}
    for variant in variants:
        blas = {"mm", "addmm", "bmm"} & set(variant.lean.externs)
        assert (not blas) if variant.kind == "hint" else blas, variant


@pytest.mark.parametrize("name", ["reductions", "extern"])
def test_a_fresh_serving_process_imports_no_compiler(built: dict[str, Any], name: str) -> None:
    case = built[name]
    out = os.path.join(str(case["folder"]), f"{name}-lean.pt")
    result = child("artifact", case["path"], case["cases"], out)
    assert result["compiler_modules"] == [] and result["dynamo"] is False, result
    # the same launches as the build ran, bit for bit, in another process
    for got, want in zip(torch.load(out), case["outputs"], strict=True):
        assert all(same_bits(a, b) for a, b in zip(got, want, strict=True))
    upstream_out = os.path.join(str(case["folder"]), f"{name}-upstream.pt")
    upstream = child("artifact", case["path"], case["cases"], upstream_out, lean=False)
    assert upstream["compiler_modules"], upstream  # upstream's path imports inductor
    for got, want in zip(torch.load(out), torch.load(upstream_out), strict=True):
        for a, b in zip(got, want, strict=True):
            if name == "extern":  # kernels of one config: upstream runs the same ones
                assert same_bits(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def readme_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _common import llama

    cache = str(tmp_path_factory.mktemp("gpu-lean-llama"))
    model = llama("issue", "cuda", torch.bfloat16)
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randint(0, 32000, (1, 128), device="cuda"),), dynamic={0: [1]},
            hints=[16, 256], cache=cache, warmup=False,
        )  # fmt: skip
    variants = [v for a in (compiled.artifact, *[p.artifact for p in compiled.pieces.values()])
                for v in a.manifest.variants]  # fmt: skip
    assert variants and all(v.lean is not None and v.lean.triton for v in variants), variants
    return cache


@pytest.mark.parametrize("cudagraphs", ["0", "1"])
def test_the_readme_llama_serves_lean_bitwise_as_upstream(
    readme_llama: str, cudagraphs: str, tmp_path: Any
) -> None:
    got, want = lean_and_upstream("llama", readme_llama, cudagraphs, tmp_path)
    assert set(got) == set(want)
    assert all(same_bits(got[k], want[k]) for k in got)


@pytest.fixture(scope="module")
def decode_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from decode_helpers import VOCAB, build, new_cache

    cache = str(tmp_path_factory.mktemp("gpu-lean-decode"))
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    call = {"input_ids": torch.randint(0, VOCAB, (2, 7), device="cuda"),
            "past_key_values": new_cache(model), "use_cache": True}  # fmt: skip
    with torch.no_grad():
        precompile.compile_model(
            model, (), call, dynamic={"input_ids": [0, 1]},
            hints={("input_ids", 0): [1, 8], ("input_ids", 1): [1, 8]}, sizes=[],
            cache=cache, warmup=False,
        )  # fmt: skip
    return cache


@pytest.mark.parametrize("cudagraphs", ["0", "1"])
def test_the_decode_loop_serves_lean_bitwise_as_upstream(
    decode_cache: str, cudagraphs: str, tmp_path: Any
) -> None:
    lean, upstream = lean_and_upstream("decode", decode_cache, cudagraphs, tmp_path)
    for got, want in zip(lean, upstream, strict=True):
        assert torch.equal(got, want)
