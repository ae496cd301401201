"""The GEMM policy (``precompile._gemm_policy``, an internal module: its subject): CUDA
hint variants use Triton GEMM templates (their epilogue fusions untimed), everything
else (and a decode variant on cuDNN attention) compiles as inductor would, and a
caller's own choice of GEMM autotuning or epilogue timing stays theirs. The GPU side
(which kernels the variants hold, and that they run lean) is in ``test_gpu_lean.py``."""

from __future__ import annotations

import pytest

from precompile._gemm_policy import (
    CALLER_CHOICES,
    EPILOGUE_VARIABLE,
    EPILOGUES_UNTIMED,
    POLICY,
    TRITON_GEMMS,
    gemm_options,
)

# What the policy patches into a CUDA hint variant's config where the caller chose nothing.
TEMPLATES = {**TRITON_GEMMS, **EPILOGUES_UNTIMED}


@pytest.fixture(autouse=True)
def _no_epilogue_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EPILOGUE_VARIABLE, raising=False)


def test_cuda_hint_variants_take_triton_templates_with_untimed_epilogues() -> None:
    chosen = gemm_options({}, device="cuda", dynamic=True, caller_config=frozenset())
    assert chosen == {"config_patches": TEMPLATES}
    assert TEMPLATES["benchmark_epilogue_fusion"] is False


def test_a_callers_choice_of_epilogue_timing_stays_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set in the options, in the process's inductor config or through inductor's
    environment variable: the templates stay, the epilogue timing is the caller's."""
    patched = {"config_patches": {"benchmark_epilogue_fusion": True}}
    chosen = gemm_options(patched, device="cuda", dynamic=True, caller_config=frozenset())
    assert chosen == {"config_patches": {"benchmark_epilogue_fusion": True, **TRITON_GEMMS}}
    changed = frozenset({"benchmark_epilogue_fusion"})
    chosen = gemm_options({}, device="cuda", dynamic=True, caller_config=changed)
    assert chosen == {"config_patches": dict(TRITON_GEMMS)}
    monkeypatch.setenv(EPILOGUE_VARIABLE, "1")
    chosen = gemm_options({}, device="cuda", dynamic=True, caller_config=frozenset())
    assert chosen == {"config_patches": dict(TRITON_GEMMS)}


@pytest.mark.parametrize(("device", "dynamic"), [("cpu", True), ("cuda", False), ("cpu", False)])
def test_other_variants_compile_as_inductor_would(device: str, dynamic: bool) -> None:
    assert gemm_options({}, device=device, dynamic=dynamic, caller_config=frozenset()) is None


def test_a_decode_variant_on_cudnn_attention_keeps_inductors_gemms() -> None:
    """A new batch builds a cuDNN plan there anyway; cuBLAS was faster per step."""
    chosen = gemm_options({}, device="cuda", dynamic=True, caller_config=frozenset(),
                          cudnn_decode=True)  # fmt: skip
    assert chosen is None


def test_the_callers_other_options_and_patches_are_kept() -> None:
    options = {"config_patches": {"triton.cudagraphs": False}, "cpp_wrapper": False}
    chosen = gemm_options(options, device="cuda", dynamic=True, caller_config=frozenset())
    assert chosen == {"cpp_wrapper": False,
                      "config_patches": {"triton.cudagraphs": False, **TEMPLATES}}  # fmt: skip
    assert options == {"config_patches": {"triton.cudagraphs": False}, "cpp_wrapper": False}


@pytest.mark.parametrize("name", sorted(CALLER_CHOICES))
def test_a_callers_choice_of_gemm_autotuning_stays_theirs(name: str) -> None:
    patched = {"config_patches": {name: False if name != "max_autotune_gemm_backends" else "ATEN"}}
    assert gemm_options(patched, device="cuda", dynamic=True, caller_config=frozenset()) is None
    assert gemm_options({}, device="cuda", dynamic=True, caller_config=frozenset({name})) is None


def test_a_process_wide_config_choice_is_seen() -> None:
    """``torch._inductor.config.max_autotune_gemm_backends = "ATEN"`` in the caller's
    process is a choice too: the adapter reports it among the changed entries."""
    import torch._inductor.config as config

    from precompile._compiler_config import inductor_config_changes

    assert "max_autotune_gemm_backends" not in inductor_config_changes()
    with config.patch(max_autotune_gemm_backends="ATEN"):
        assert "max_autotune_gemm_backends" in inductor_config_changes()


def test_both_cache_keys_name_the_policy() -> None:
    """A build under another policy compiled other code: its entries are other keys."""
    import torch

    from precompile._cache_key import model_factors

    model = torch.nn.Linear(4, 4).eval()
    factors = model_factors(model, (torch.randn(3, 4),), {}, {0: {0}}, [8], [1], {})
    assert factors["gemm_policy"] == POLICY


def test_a_variant_templates_cannot_serve_compiles_with_the_callers_options(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Inductor failing on the templates (no template fits the GEMM's dtype, say) is not
    the end of the build: the variant compiles with the caller's options, logged."""
    import logging

    import sympy

    from precompile import _standalone
    from precompile._variant_plan import VariantRequest

    calls: list[dict[str, object]] = []

    def compile_variant(gm: object, graph: object, point: object, *, dynamic: bool,
                        options: dict[str, object], to_compile: object = None) -> str:  # fmt: skip
        calls.append(options)
        if "max_autotune_gemm_backends" in options.get("config_patches", {}):  # type: ignore[operator]
            raise RuntimeError("NoValidChoicesError: no choices for mm")
        return "compiled"

    monkeypatch.setattr(_standalone.variant_compile, "compile_variant", compile_variant)
    monkeypatch.setattr(_standalone.variant_compile, "decode_attention_on_cudnn",
                        lambda gm, graph, point: False)  # fmt: skip
    monkeypatch.setattr(_standalone.variant_compile, "graph_device", lambda graph: "cuda")
    request = VariantRequest("hint", (16,))
    with caplog.at_level(logging.INFO, logger="precompile.compile"):
        got = _standalone.variant_compile.compile_under_policy(
            None,
            None,
            {sympy.Symbol("s0"): 16},
            request,
            {"config_patches": {"a": 1}},
            0,  # type: ignore[arg-type]
        )
    assert got == "compiled"
    assert calls == [{"config_patches": {"a": 1, **TEMPLATES}}, {"config_patches": {"a": 1}}]
    assert "Triton GEMM templates failed (RuntimeError: NoValidChoicesError" in caplog.text
    calls.clear()
    static = VariantRequest("static", (16,))
    _standalone.variant_compile.compile_under_policy(None, None, {}, static, {}, 1)  # type: ignore[arg-type]
    assert calls == [{}]


def test_a_hint_variant_that_serves_one_size_keeps_inductors_gemms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hint point with every dim at 0 or 1 is specialized by the trace (a decode step
    for one row): one size, as an exact-size variant, so cuBLAS, which was faster there."""
    import sympy

    from precompile import _standalone
    from precompile._variant_plan import VariantRequest

    calls: list[dict[str, object]] = []

    def compile_variant(gm: object, graph: object, point: object, *, dynamic: bool,
                        options: dict[str, object], to_compile: object = None) -> str:  # fmt: skip
        calls.append(options)
        return "compiled"

    cudnn: list[bool] = [False]
    monkeypatch.setattr(_standalone.variant_compile, "compile_variant", compile_variant)
    monkeypatch.setattr(_standalone.variant_compile, "decode_attention_on_cudnn",
                        lambda gm, graph, point: cudnn[0])  # fmt: skip
    monkeypatch.setattr(_standalone.variant_compile, "graph_device", lambda graph: "cuda")
    batch, length = sympy.Symbol("s0"), sympy.Symbol("s1")
    request = VariantRequest("hint", (1, 1))
    _standalone.variant_compile.compile_under_policy(
        None, None, {batch: 1, length: 1}, request, {}, 0
    )  # type: ignore[arg-type]
    assert calls == [{}]
    _standalone.variant_compile.compile_under_policy(
        None, None, {batch: 8, length: 1}, request, {}, 1
    )  # type: ignore[arg-type]
    assert calls[1] == {"config_patches": TEMPLATES}
    cudnn[0] = True  # the same point, its attention on cuDNN (a decode step): cuBLAS
    _standalone.variant_compile.compile_under_policy(
        None, None, {batch: 8, length: 1}, request, {}, 2
    )  # type: ignore[arg-type]
    assert calls[2] == {}
