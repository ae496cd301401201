"""The lean path: variants whose AOTAutograd wrapping the compile side proved trivial run
their generated code directly, with no torch compiler module imported. Their outputs
must be bit-identical to upstream's path (values, dtypes, strides, structure, aliasing,
Dynamo's dynamic-dim marks); a serving process that loads one imports neither Dynamo nor
inductor; and graphs whose wrapping is not trivial keep upstream's path, correctly."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import Compiled, capture, run_python

import precompile
from precompile.runtime import CorruptArtifactError, Manifest
from precompile.runtime.compiler_interface import MemoryPayloads

DYNAMIC_MARKS = ("_dynamo_propagated_dynamic_indices", "_dynamo_weak_dynamic_indices")


def _twins(art: precompile.CompiledArtifact) -> tuple[Any, Any]:
    """The artifact as compiled (lean where proven) and the same one on upstream's path."""
    manifest = art.manifest
    payloads = MemoryPayloads({d: art.payload_bytes(d) for d in manifest.payload_digests})
    upstream = dataclasses.replace(
        manifest, variants=tuple(dataclasses.replace(v, lean=None) for v in manifest.variants)
    )
    return (
        precompile.CompiledArtifact(manifest, payloads),
        precompile.CompiledArtifact(upstream, payloads),
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaNs and signed zeros compared exactly)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def assert_identical(lean: Any, upstream: Any, inputs: list[Any]) -> None:
    """Same structure and, per output, same type, dtype, device, sizes, strides, offset,
    grad, bytes and Dynamo marks; the same aliasing among outputs and with inputs."""
    assert type(lean) is type(upstream)
    lean_leaves, upstream_leaves = list(_leaves(lean)), list(_leaves(upstream))
    assert len(lean_leaves) == len(upstream_leaves)
    input_storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    for ours, theirs in zip(lean_leaves, upstream_leaves, strict=True):
        assert type(ours) is type(theirs)
        if not isinstance(ours, torch.Tensor):
            assert ours == theirs
            continue
        assert (ours.dtype, ours.device, ours.shape) == (theirs.dtype, theirs.device, theirs.shape)
        assert ours.stride() == theirs.stride()
        assert ours.storage_offset() == theirs.storage_offset()
        assert ours.requires_grad == theirs.requires_grad
        assert torch.equal(_bits(ours), _bits(theirs))
        for mark in DYNAMIC_MARKS:
            assert getattr(ours, mark, None) == getattr(theirs, mark, None), mark
        assert (ours.untyped_storage().data_ptr() in input_storages) == (
            theirs.untyped_storage().data_ptr() in input_storages
        )

    def sharing(leaves: list[Any]) -> list[tuple[int, int]]:
        storages = [
            t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None for t in leaves
        ]
        return [
            (i, j)
            for i in range(len(storages))
            for j in range(i + 1, len(storages))
            if storages[i] is not None and storages[i] == storages[j]
        ]

    assert sharing(lean_leaves) == sharing(upstream_leaves)


def _runs_lean(art: precompile.CompiledArtifact, index: int) -> bool:
    return bool(getattr(art.variant_callable(index), "lean", False))


# -- bit-identical outputs ---------------------------------------------------------------
def test_mlp_and_attention_are_lean_and_bit_identical(mlp: Compiled, attention: Compiled) -> None:
    cases: list[tuple[Compiled, list[tuple[int, ...]]]] = [
        (mlp, [(1, 32), (3, 32), (5, 32), (40, 32), (300, 32)]),
        (attention, [(1, 1, 32), (2, 7, 32), (3, 64, 32), (9, 70, 32)]),
    ]
    for compiled, shapes in cases:
        assert all(v.lean is not None for v in compiled.artifact.variants)
        lean, upstream = _twins(compiled.artifact)
        torch.manual_seed(0)
        used = set()
        for shape in shapes:
            flat = compiled.captured.flat(torch.randn(*shape))
            with torch.no_grad():
                ours, theirs = lean(*flat), upstream(*flat)
            assert_identical(ours, theirs, flat)
            index = lean.variant_for(*flat)
            used.add(index)
            assert _runs_lean(lean, index) and not _runs_lean(upstream, index)
        assert len(used) > 1, "the sizes should reach several variants"


def test_precompile_lean_0_loads_every_variant_through_upstream(
    mlp: Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRECOMPILE_LEAN", "0")
    lean, _ = _twins(mlp.artifact)
    assert not any(_runs_lean(lean, v.index) for v in lean.variants)


def _recording(backend: Callable[..., Any], calls: list[tuple[Any, tuple[Any, ...]]]) -> Any:
    """A backend keeping each graph's artifact and every call's flat inputs."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        function = backend(gm, example_inputs)
        artifact = function.artifact

        def call(*args: Any) -> Any:
            calls.append((artifact, args))
            return function(*args)

        return call

    return compile_graph


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_transformers_models_are_lean_and_bit_identical(name: str) -> None:
    """The models and hints of test_real_models (so a full run reuses its cache entries):
    every graph Dynamo hands the backend is lean, and replaying each call's inputs on the
    lean and upstream paths gives identical outputs."""
    pytest.importorskip("transformers")
    from tiny_models_helpers import SIZES, VOCAB, tiny_bert, tiny_gpt2, tiny_llama

    builds = {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert}
    hints = {"llama": [4, 64], "gpt2": [16], "bert": [16]}[name]
    model = builds[name]()
    calls: list[tuple[Any, tuple[Any, ...]]] = []
    torch._dynamo.reset()
    backend = _recording(precompile.backend(hints=hints), calls)
    dynamic = None if name == "bert" else True
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    torch.manual_seed(1)
    with torch.no_grad():
        for batch, seq in [(2, 9), *SIZES] if name == "bert" else SIZES:
            ids = torch.randint(0, VOCAB, (batch, seq))
            if name != "bert":
                compiled(ids, use_cache=False)
                continue
            mask = torch.ones(batch, seq, dtype=torch.long)
            if (batch, seq) == (2, 9):
                for tensor in (ids, mask):
                    torch._dynamo.mark_dynamic(tensor, 0)
                    torch._dynamo.mark_dynamic(tensor, 1)
            compiled(input_ids=ids, attention_mask=mask)
    assert calls
    twins = {}
    for artifact, args in calls:
        if id(artifact) not in twins:
            assert all(v.lean is not None for v in artifact.variants), artifact.manifest
            twins[id(artifact)] = _twins(artifact)
        lean, upstream = twins[id(artifact)]
        flat = list(args)
        with torch.no_grad():
            assert_identical(lean(*flat), upstream(*flat), flat)
        assert _runs_lean(lean, lean.variant_for(*flat))


# -- a serving process imports no compiler ---------------------------------------------
SERVE = """
import sys, torch, precompile
art = precompile.CompiledArtifact.load(path={path!r}, format={fmt!r})
cases = torch.load({cases!r})
with torch.no_grad():
    outs = [art(*flat) for flat in cases["args"]]
for out, want in zip(outs, cases["expected"]):
    assert len(out) == len(want)
    for a, b in zip(out, want):
        assert a.stride() == b.stride() and a.dtype == b.dtype, (a.stride(), b.stride())
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                           b.contiguous().view(-1).view(torch.uint8))
compiler = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
print("compiler modules", len(compiler), compiler[:8])
print("variants", sorted({{art.variant_for(*f) for f in cases["args"]}}))
"""


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_a_serving_process_imports_no_compiler_module(
    mlp: Compiled, saved: dict[str, str], fmt: str, tmp_path: Any
) -> None:
    _, upstream = _twins(mlp.artifact)
    torch.manual_seed(0)
    args = [mlp.captured.flat(torch.randn(n, 32)) for n in (1, 3, 40, 300)]
    with torch.no_grad():
        expected = [upstream(*flat) for flat in args]
    cases = os.path.join(str(tmp_path), "cases.pt")
    torch.save({"args": args, "expected": expected}, cases)
    out = run_python(SERVE.format(path=saved[fmt], fmt=fmt, cases=cases))
    assert "compiler modules 0 []" in out, out
    ran = json.loads(out.split("variants ")[1].splitlines()[0])
    assert len(ran) >= 2, out


# -- graphs whose wrapping is not trivial -----------------------------------------------
class WritesInput(torch.nn.Module):
    """Writes its second input in place (kept in the graph): lean, with a version bump."""

    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.add_(x)
        return buf * 2


class ReturnsAView(torch.nn.Module):
    """An output is a view of an input: upstream regenerates it, so not lean."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t(), x.sin()


class ReturnsAliasedOutputs(torch.nn.Module):
    """One output is a view of another: inductor returns both from one buffer and
    AOTAutograd's inference wrapper leaves them as they are, so it is lean."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.cos() + 1
        return y, y.view(-1)


def _compile(model: torch.nn.Module, *inputs: torch.Tensor) -> Compiled:
    """One hint variant; with grad enabled where the model has parameters (so a
    backward graph is compiled)."""
    captured = capture(model, *inputs)
    with torch.set_grad_enabled(any(True for _ in model.parameters())):
        artifact = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[8], cache=False
        )
    return Compiled(captured, artifact)


def test_outputs_sharing_a_buffer_share_it_on_the_lean_path() -> None:
    compiled = _compile(ReturnsAliasedOutputs(), torch.randn(5, 4))
    assert all(v.lean is not None for v in compiled.artifact.variants)
    lean, upstream = _twins(compiled.artifact)
    flat = compiled.captured.flat(torch.randn(7, 3))
    with torch.no_grad():
        ours, theirs = lean(*flat), upstream(*flat)
    assert_identical(ours, theirs, flat)
    assert ours[0].data_ptr() == ours[1].data_ptr()


def test_a_graph_writing_an_input_is_lean_and_bumps_its_version() -> None:
    compiled = _compile(WritesInput(), torch.randn(5, 4), torch.randn(5, 4))
    (variant,) = compiled.artifact.variants
    assert variant.lean is not None and variant.lean.bump_versions
    lean, upstream = _twins(compiled.artifact)
    x, buf = torch.randn(6, 4), torch.randn(6, 4)
    results = []
    for art in (lean, upstream):
        target = buf.clone()
        flat = compiled.captured.flat(x, target)
        before = target._version
        with torch.no_grad():
            out = art(*flat)
        results.append((out, target, target._version - before))
    (ours, ours_buf, ours_bumps), (theirs, theirs_buf, theirs_bumps) = results
    assert_identical(ours, theirs, [])
    assert torch.equal(ours_buf, theirs_buf) and torch.equal(ours_buf, buf + x)
    assert ours_bumps == theirs_bumps > 0


@pytest.mark.parametrize(
    ("model", "shape", "why"),
    [
        (ReturnsAView(), (5, 4), "aliases an input"),
        (torch.nn.Linear(4, 3), (5, 4), "has a backward graph"),
    ],
    ids=["view-of-input", "training"],
)
def test_graphs_with_nontrivial_wrapping_keep_upstreams_path(
    model: torch.nn.Module, shape: tuple[int, ...], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="precompile"):
        compiled = _compile(model, torch.randn(*shape))
    assert all(v.lean is None for v in compiled.artifact.variants)
    assert why in caplog.text
    x = torch.randn(7, 4)
    eager_input, ours_input = x.clone(), x.clone()
    want = model(eager_input)
    got = compiled.artifact(*compiled.captured.flat(ours_input))
    want_leaves = list(_leaves(want))
    got_leaves = list(_leaves(got))
    assert len(got_leaves) == len(want_leaves)
    for ours, theirs in zip(got_leaves, want_leaves, strict=True):
        torch.testing.assert_close(ours, theirs)
        assert ours.stride() == theirs.stride()
        assert ours.requires_grad == theirs.requires_grad
    assert ours_input.shape == eager_input.shape and torch.equal(ours_input, eager_input)
    if isinstance(model, ReturnsAView):
        assert got_leaves[0].data_ptr() == ours_input.data_ptr()  # still a view of it


# -- the manifest and formats ----------------------------------------------------------
def test_lean_fields_round_trip_and_bad_ones_are_corrupt(mlp: Compiled) -> None:
    document = mlp.artifact.manifest.to_json()
    assert Manifest.from_json(json.loads(json.dumps(document))) == mlp.artifact.manifest
    lean = document["variants"][0]["lean"]
    assert lean["externs"] and all(p.startswith("torch.") for p in lean["externs"].values())
    bad = {
        "an extern outside torch": {"externs": {"addmm": "os.system"}},
        "an extern into inductor": {"externs": {"addmm": "torch._inductor.x"}},
        "a bump of no input": {"bump_versions": [10_000]},
        "dims with no attribute": {"dynamic_dims": [[0, [0]]], "dynamic_attribute": None},
        "a stray attribute": {"dynamic_dims": [], "dynamic_attribute": "_dynamo_x"},
        "not a digest": {"source": "abc"},
        "an unknown key": {"extra": 1},
    }
    for what, change in bad.items():
        broken = json.loads(json.dumps(document))
        broken["variants"][0]["lean"].update(change)
        with pytest.raises(CorruptArtifactError):
            Manifest.from_json(broken)
            pytest.fail(f"a manifest with {what} was read")
    # a version 3 manifest (no lean fields) still reads, every variant on upstream's path
    old = json.loads(json.dumps(document))
    old["format_version"] = 3
    for variant in old["variants"]:
        del variant["lean"]
    assert all(v.lean is None for v in Manifest.from_json(old).variants)


def test_an_edited_unpacked_variant_leaves_the_lean_path(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any
) -> None:
    edited = os.path.join(str(tmp_path), "edited")
    shutil.copytree(saved["unpacked"], edited)
    variant = mlp.artifact.variants[0]
    code = os.path.join(edited, "variants", variant.payload, "output_code.py")
    with open(code, "a") as handle:
        handle.write("\n# an edit\n")
    loaded = precompile.CompiledArtifact.load(path=edited, format="unpacked")
    edited_graphs = {variant.payload}
    for v in loaded.variants:
        assert (v.lean is None) == (v.payload in edited_graphs)
    intact = precompile.CompiledArtifact.load(path=saved["unpacked"], format="unpacked")
    assert all(v.lean is not None for v in intact.variants)


# -- a model served from the cache imports no compiler either -------------------------
class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


SERVE_MODEL = """
import sys, torch, precompile
sys.path[:0] = ["tests", "tests/models"]
from test_lean import TwoLayers
torch.manual_seed(0)
model = TwoLayers().eval()
with torch.no_grad():
    compiled = precompile.compile_model(model, (torch.randn(4, 16),), dynamic={{0: [0]}},
                                        hints=[8], cache={cache!r}, compile=False)
    x = torch.randn(6, 16)
    assert torch.equal(compiled(x), model(x)) or torch.allclose(compiled(x), model(x))
compiler = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
print("compiler modules", len(compiler), compiler[:8])
"""


def test_a_model_served_from_the_cache_imports_no_compiler(tmp_path: Any) -> None:
    """compile_model's lookup keys the compiler configs: at their defaults (nothing
    imported, no variable of theirs set) it needs no import of inductor, and a build
    with the same configs computed the same key."""
    cache = str(tmp_path / "cache")
    torch.manual_seed(0)
    model = TwoLayers().eval()
    with torch.no_grad():
        precompile.compile_model(model, (torch.randn(4, 16),), dynamic={0: [0]}, hints=[8],
                                 cache=cache, warmup=False)  # fmt: skip
    out = run_python(SERVE_MODEL.format(cache=cache))
    assert "compiler modules 0 []" in out, out


DIGEST = """
import os, sys, torch
from precompile import _compiler_config as compiler_config
before = compiler_config.codegen_config_digest()
# imported only where a variable the config reads is set
assert ("torch._inductor.config" in sys.modules) == ("TORCHINDUCTOR_MAX_AUTOTUNE" in os.environ)
import torch._inductor.config as config
assert compiler_config.codegen_config_digest() == before  # imported, at its defaults
config.max_autotune = not config.max_autotune
changed = compiler_config.codegen_config_digest()
config.max_autotune = not config.max_autotune
print(before, changed, compiler_config.codegen_config_digest())
"""


def test_the_config_digest_is_the_same_with_or_without_inductor_imported() -> None:
    before, changed, after = run_python(DIGEST).split()
    assert changed != before and after == before
    # a variable the config modules read changes the digest (and is read without import)
    with_env = run_python(DIGEST, env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}).split()
    assert with_env[0] != before
    # one torchrun sets per rank, read by inductor's config only to name its logs: the
    # ranks keep one key (and share one compile)
    assert run_python(DIGEST, env={"ROLE_RANK": "1"}).split()[0] == before
