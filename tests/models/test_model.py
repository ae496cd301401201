"""Whole-model precompile: a tiny Llama and GPT-2 compiled once, then served by fresh
processes with no Dynamo frame traced, no inductor compile and no compiler process; a
changed source file is a miss; what cannot be one graph is refused clearly."""

from __future__ import annotations

import json
import os
import re
import textwrap
from typing import Any

import pytest
import torch
from cache_helpers import cache_cli
from conftest import MLP, run_python
from tiny_models_helpers import VOCAB, tiny_gpt2, tiny_llama
from warm_start_helpers import AUDIT, COUNTED

import precompile
from precompile.cache import ArtifactCache
from precompile.runtime._binary_format import write_binary

SEQUENCES = [1, 2, 7, 33, 100, 300]


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="module")
def compiled_llama(llama_cache: str) -> tuple[Any, Any]:
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (ids,), {"use_cache": False}, dynamic={0: [1]}, hints=[16], cache=llama_cache
        )
    return model, compiled


def _matches_eager(model: Any, compiled: Any) -> None:
    torch.manual_seed(3)
    with torch.no_grad():
        for seq in SEQUENCES:
            ids = torch.randint(0, VOCAB, (1, seq))
            ours, eager = compiled(ids, use_cache=False), model(ids, use_cache=False)
            assert type(ours) is type(eager)  # the model's own output class, rebuilt
            torch.testing.assert_close(ours.logits, eager.logits, rtol=1e-4, atol=1e-4)


def test_llama_outputs_match_eager(compiled_llama: tuple[Any, Any]) -> None:
    model, compiled = compiled_llama
    _matches_eager(model, compiled)
    assert compiled.wait_warm(timeout=120)


def test_gpt2_outputs_match_eager(tmp_path: Any) -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (ids,), {"use_cache": False}, dynamic={0: [1]}, hints=[16], cache=str(tmp_path)
        )
    _matches_eager(model, compiled)


def test_cache_ls_says_what_each_entry_is(
    compiled_llama: tuple[Any, Any], llama_cache: str
) -> None:
    """A cache holding a compile_model model (the module's) and a graph compiled by
    ``precompile.backend``: each row names the model's class and config, or the graph's
    function and inputs, with variants, device, size and tags; ``--json`` the same."""
    _, compiled = compiled_llama
    store = ArtifactCache(llama_cache)
    store.tag("tiny-llama", compiled.cache_key)
    torch.manual_seed(0)
    mlp = MLP(width=32, hidden=64).eval()
    x = torch.randn(5, 32)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(mlp, backend=precompile.backend(hints=[16], cache=store))(x)
    torch._dynamo.reset()
    (graph_key,) = {e.key for e in store.entries()} - {compiled.cache_key}

    text = cache_cli("--root", llama_cache, "ls")
    assert text.returncode == 0, text.stderr
    rows = {line[:12]: line for line in text.stdout.splitlines()}
    model_row, graph_row = rows[compiled.cache_key[:12]], rows[graph_key[:12]]
    device = store.entries()[0].factors["device"]
    assert "model LlamaForCausalLM (llama, layers=1, hidden=32, heads=2, vocab=128, " in model_row
    assert re.search(r"i64\[1, (s\d+)\].*hints \1=16; sizes \1=1 ", model_row), model_row
    assert device in model_row and model_row.rstrip().endswith("tiny-llama")
    assert re.search(r"graph MLP\.forward \(demo\.py:\d+\)", graph_row), graph_row
    assert re.search(r"f32\[(s\d+), 32\].* hints \1=16 ", graph_row), graph_row
    assert device in graph_row and graph_row.rstrip().endswith(" -")

    listed = {
        e["key"]: e for e in json.loads(cache_cli("--root", llama_cache, "ls", "--json").stdout)
    }
    model, graph = listed[compiled.cache_key], listed[graph_key]
    assert model["kind"] == "model" and model["tags"] == ["tiny-llama"]
    assert model["name"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert model["config"].startswith("llama, layers=1, hidden=32, heads=2, vocab=128, ")
    assert model["config"].endswith(" params, float32")
    (symbol,) = model["hints"][0]
    assert model["hints"] == [{symbol: 16}] and model["sizes"] == [{symbol: 1}]
    assert graph["kind"] == "graph" and graph["tags"] == [] and graph["sizes"] == []
    assert graph["name"].startswith("MLP.forward (demo.py:")
    (symbol,) = graph["hints"][0]
    assert graph["hints"] == [{symbol: 16}] and f"f32[{symbol}, 32]" in graph["inputs"]
    assert model["device"] == graph["device"] == device
    assert all(e["size"] > 0 and e["last_used"] > 0 for e in (model, graph))


WARM = (
    AUDIT
    + COUNTED
    + """
import sys, time, torch, precompile
sys.path.insert(0, "tests")
from tiny_models_helpers import VOCAB, tiny_llama
model = tiny_llama()
torch.manual_seed(3)
with torch.no_grad():
    began = time.perf_counter()
    {load}
    ids = torch.randint(0, VOCAB, (1, 7))
    out = compiled(ids, use_cache=False)
    first = time.perf_counter() - began
    worst = 0.0
    for seq in {sequences}:
        ids = torch.randint(0, VOCAB, (1, seq))
        diff = compiled(ids, use_cache=False).logits - model(ids, use_cache=False).logits
        worst = max(worst, diff.abs().max().item())
print("frames", len(frames), "compiles", len(compiles), "spawned", len(spawned), spawned)
print("first", round(first, 3), "worst", worst)
"""
)


def test_a_fresh_process_finds_the_model_without_tracing(
    compiled_llama: tuple[Any, Any], llama_cache: str
) -> None:
    load = (
        "compiled = precompile.compile_model(model, (torch.randint(0, VOCAB, (1, 7)),), "
        f"{{'use_cache': False}}, dynamic={{0: [1]}}, hints=[16], cache={llama_cache!r})"
    )
    out = run_python(WARM.replace("{load}", load).replace("{sequences}", repr(SEQUENCES)))
    assert "frames 0 compiles 0 spawned 0 []" in out, out
    assert float(out.split("worst")[1]) < 1e-4, out


def test_save_and_load_model_in_a_fresh_process(
    compiled_llama: tuple[Any, Any], tmp_path: Any
) -> None:
    _, compiled = compiled_llama
    path = os.path.join(str(tmp_path), "llama.pt2c")
    compiled.save(path)
    load = f"compiled = precompile.load_model(model, path={path!r})"
    out = run_python(WARM.replace("{load}", load).replace("{sequences}", repr(SEQUENCES)))
    assert "frames 0 compiles 0 spawned 0 []" in out, out
    assert float(out.split("worst")[1]) < 1e-4, out
    other = tiny_gpt2()
    with pytest.raises(precompile.IncompatibleArtifactError, match="LlamaForCausalLM"):
        precompile.load_model(other, path=path)


HOSTILE = """
import sys, torch, precompile
sys.path.insert(0, "tests")
from tiny_models_helpers import VOCAB, tiny_llama
model = tiny_llama()
compiled = precompile.load_model(model, path={path!r}, warmup=False)
good = torch.randint(0, VOCAB, (1, 7))


def outcome(ids):
    try:
        with torch.no_grad():
            ours = compiled(ids, use_cache=False).logits
    except Exception as exc:  # the process lives on: what was raised
        return type(exc).__name__ + ": " + str(exc).splitlines()[0]
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
    same = ours.shape == eager.shape and torch.allclose(ours, eager, atol=1e-4, equal_nan=True)
    return "served, equal to eager" if same else "served, DIFFERENT from eager"


cases = {{
    "above": torch.tensor([[1, 2, VOCAB + 172]]),
    "negative": torch.tensor([[-1, 2, 3]]),
    "good after": good,
    "empty batch": torch.zeros(0, 5, dtype=torch.long),
    "empty sequence": torch.zeros(1, 0, dtype=torch.long),
    "float ids": good.float(),
    "int32 ids": good.int(),
    "long": torch.randint(0, VOCAB, (1, 2048)),
    "huge value": torch.tensor([[2**62]]),
}}
for name, ids in cases.items():
    print(name, "->", outcome(ids), flush=True)
"""


def test_hostile_requests_never_end_a_serving_process(
    compiled_llama: tuple[Any, Any], tmp_path: Any
) -> None:
    """A loaded model in a fresh process, fed token ids outside the vocabulary (above and
    negative: eager raises IndexError, where the compiled C++ kernel's own bounds check,
    inside an OpenMP region, had ended the process with SIGABRT), empty batches and
    sequences, the wrong dtype, a long sequence and a huge value: each call is served as
    eager serves it or refused with an exception, and the process lives to the end."""
    _, compiled = compiled_llama
    path = os.path.join(str(tmp_path), "llama.pt2c")
    compiled.save(path)
    out = run_python(HOSTILE.format(path=path))
    lines = dict(line.split(" -> ", 1) for line in out.splitlines() if " -> " in line)
    assert len(lines) == 9, out  # the process reached its last case
    for name in ("above", "negative", "huge value"):
        assert re.match(r"IndexOutOfRangeError: input \d+ \(argument 0\) holds", lines[name]), out
        assert f"outside the embedding's {VOCAB} rows" in lines[name], out
    assert issubclass(precompile.IndexOutOfRangeError, IndexError)  # as eager raises
    assert "holds 300" in lines["above"] and "holds -1" in lines["negative"], out
    assert lines["good after"] == "served, equal to eager", out
    assert lines["long"] == "served, equal to eager", out
    assert lines["float ids"].startswith("InputMismatchError"), out
    assert "DIFFERENT" not in out, out


def test_a_compiled_model_binds_only_to_the_model_it_was_compiled_from(
    compiled_llama: tuple[Any, Any], llama_cache: str, tmp_path: Any
) -> None:
    """Same class, same parameter names, other code: another layer count, norm epsilon,
    activation or dtype would run the compiled graph's numbers, not its own. A load
    compares the model's tensors, then every guard of the trace, naming the path."""
    _, compiled = compiled_llama
    path = str(tmp_path / "llama.pt2c")
    compiled.save(path)
    store = ArtifactCache(llama_cache)
    store.tag("tiny-llama", compiled.cache_key)
    sources = [
        {"path": path},
        {"key": compiled.cache_key, "cache": store},
        {"tag": "tiny-llama", "cache": store},  # was a TypeError (a client trial tried it)
    ]
    others = [
        (tiny_llama(num_hidden_layers=2), "differs in model_tensors"),
        (tiny_llama(rms_norm_eps=0.5), r"variance_epsilon is 0\.5, compiled with 1e-0"),
        (tiny_llama(hidden_act="gelu"), r"model\.model\.layers\.0\.mlp\.act_fn is a .*GELU"),
        (tiny_llama().double(), "differs in model_tensors"),
    ]
    for other, said in others:
        for source in sources:
            with pytest.raises(precompile.IncompatibleArtifactError, match=said):
                precompile.load_model(other, warmup=False, **source)
    unchecked = compiled.plan.to_json()
    del unchecked["identity"]  # as saved before the plan recorded its model
    write_binary(str(tmp_path / "old.pt2c"), compiled.artifact.manifest,
                 compiled.artifact._payloads, None, model=unchecked)  # fmt: skip
    with pytest.raises(precompile.IncompatibleArtifactError, match="older precompile"):
        precompile.load_model(tiny_llama(), path=str(tmp_path / "old.pt2c"), warmup=False)
    for source in sources:  # a fresh copy of the model it was compiled from binds
        model = tiny_llama()
        loaded = precompile.load_model(model, warmup=False, **source)
        ids = torch.randint(0, VOCAB, (1, 9))
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits
            )


def test_load_model_of_a_graph_artifact_says_what_it_is(
    compiled_llama: tuple[Any, Any], saved: dict[str, str]
) -> None:
    """A graph artifact is not a compiled model: the error names the file and what to
    use (was 'model plan is missing or not a model plan', naming no file)."""
    model, _ = compiled_llama
    with pytest.raises(
        precompile.InvalidOptionError, match=r"is a compiled graph.*CompiledArtifact"
    ):
        precompile.load_model(model, saved["binary"], warmup=False)


def test_calls_outside_the_compiled_structure_are_refused(compiled_llama: tuple[Any, Any]) -> None:
    model, compiled = compiled_llama
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        with pytest.raises(
            precompile.InputMismatchError,
            match=r"structured as 1 positional argument\(s\) and keywords: none, but the model "
            r"was compiled for 1 positional argument\(s\) and keywords: use_cache",
        ):  # said in call terms (was two raw TreeSpec reprs)
            compiled(ids)  # use_cache missing
        with pytest.raises(precompile.InputMismatchError, match="compiled for False"):
            compiled(ids, use_cache=True)
        with pytest.raises(precompile.InputMismatchError, match="dtype int64, got int32"):
            compiled(ids.int(), use_cache=False)
        # read a size off a missing dim: IndexError once; a (1, 1, 12) tensor was told the
        # contract of the trace at length 1 ("input 0 ... rank 2 with shape (1, 1)"): the
        # call's own contract now, by the argument's name, whichever graph refused it
        for wrong in (ids[0], ids[0, 0], ids.view(1, 1, 7), ids[:, :1].view(1, 1, 1), ids[0, :1]):
            with pytest.raises(
                precompile.InputMismatchError,
                match=r"^argument 0 should have rank 2 with shape \(1, \*\) \(\*: a dynamic "
                r"length\), the shape the model was compiled for; got shape "
                + re.escape(str(tuple(wrong.shape))),
            ):
                compiled(wrong, use_cache=False)
        with pytest.raises(
            precompile.InputMismatchError, match=r"^argument 0 .*got shape \(2, 1\)"
        ):
            compiled(torch.zeros(2, 1, dtype=torch.long), use_cache=False)  # batch static at 1
        model.train()
        try:
            with pytest.raises(precompile.InputMismatchError, match="train"):
                compiled(ids, use_cache=False)
        finally:
            model.eval()


def test_labels_compiled_from_the_ids_tensor_are_an_input_of_their_own(tmp_path: Any) -> None:
    """``labels=input_ids`` (one tensor in two slots, the usual loss call) was traced as
    one graph input bound to ``labels``: a call with other labels was answered from the
    labels alone (logits 0.56 off eager), and labels holding -100 (transformers' ignore
    index) were refused as ids ("outside the embedding's rows"). Each slot is an input of
    its own now, ``dynamic`` for ``input_ids`` covering its twin: losses are eager's."""
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (), {"input_ids": ids, "labels": ids, "use_cache": False},
            dynamic={"input_ids": {1: (2, None)}}, hints={("input_ids", 1): [8]}, sizes=[],
            cache=str(tmp_path), warmup=False,
        )  # fmt: skip
        # the twin slot's length got input_ids' hint (it was compiled at the example's 6)
        assert [set(v.point.values()) for v in compiled.artifact.variants] == [{8}]
        torch.manual_seed(5)
        for length in (6, 9):
            ids = torch.randint(0, VOCAB, (2, length))
            ignored = ids.clone()
            ignored[:, :2] = -100
            for labels in (ignored, torch.randint(0, VOCAB, (2, length)), ids):
                ours = compiled(input_ids=ids, labels=labels, use_cache=False)
                eager = model(input_ids=ids, labels=labels, use_cache=False)
                torch.testing.assert_close(ours.logits, eager.logits, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(ours.loss, eager.loss, rtol=1e-4, atol=1e-4)
        with pytest.raises(precompile.IndexOutOfRangeError, match="outside the embedding"):
            compiled(input_ids=ignored, labels=ids, use_cache=False)  # ids are still checked


MODEL_SOURCE = """
import torch
from scaler_helper import activate

class Scaler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return activate(self.proj(x)) * {factor}
"""
HELPER_SOURCE = """
import torch

def activate(x):  # a helper the forward calls, in a file of no module class
    return torch.relu(x){shift}
"""

# a script's start: the directory importable, precompile's log records kept
KEEP_RECORDS = """
import logging, sys, torch, precompile
sys.path.insert(0, {directory!r})
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("precompile").addHandler(Keep())
logging.getLogger("precompile").setLevel(logging.INFO)
"""

CHANGED = (
    KEEP_RECORDS
    + """
from scaler_model import Scaler
torch.manual_seed(0)
model = Scaler().eval()
x = torch.randn(5, 8)
with torch.no_grad():
    try:
        compiled = precompile.compile_model(
            model, (x,), dynamic={{0: {{0: (2, None)}}}}, cache={cache!r}, warmup=False
        )
    except precompile.ArtifactNotFoundError as exc:
        print("ArtifactNotFoundError", exc)
        sys.exit(0)
    y = torch.randn(6, 8)
    torch.testing.assert_close(compiled(y), model(y))
print("hit" if any("model cache hit" in r for r in records) else "miss")
print([r for r in records if "model cache miss" in r])
"""
)


def test_a_changed_source_file_is_a_miss_never_a_stale_hit(tmp_path: Any) -> None:
    directory = str(tmp_path / "models")
    os.makedirs(directory)
    source = os.path.join(directory, "scaler_model.py")
    cache = str(tmp_path / "cache")
    script = textwrap.dedent(CHANGED.format(directory=directory, cache=cache))
    helper = os.path.join(directory, "scaler_helper.py")
    with open(source, "w") as handle:
        handle.write(MODEL_SOURCE.format(factor=2))
    with open(helper, "w") as handle:
        handle.write(HELPER_SOURCE.format(shift=""))
    assert run_python(script).splitlines()[-2] == "miss"  # cold
    assert run_python(script).splitlines()[-2] == "hit"  # warm, no tracing
    offline = script.replace("warmup=False", "warmup=False, compile=False")
    with open(helper, "w") as handle:
        handle.write(HELPER_SOURCE.format(shift=" + 1"))  # the key cannot see this file
    # Offline, so the miss is an error that names what changed (and nothing compiles).
    out = run_python(offline)
    assert "ArtifactNotFoundError" in out and "source files changed" in out, out
    assert helper in out and "differs in: none" not in out, out
    with open(source, "w") as handle:
        handle.write(MODEL_SOURCE.format(factor=3))  # forward changed: outputs differ
    out = run_python(offline)
    assert "ArtifactNotFoundError" in out and "model_sources" in out, out


OPS_SOURCE = """
import torch
import affine_shift

library = torch.library.Library("precompile_kernel_edit", "DEF")
library.define("affine(Tensor x) -> Tensor")
# a kernel the compile traces through: the graph names the op, its code is inlined
library.impl("affine", lambda x: x * {factor} + affine_shift.shift(), "CompositeImplicitAutograd")
"""
SHIFT_SOURCE = """
import functools

@functools.lru_cache  # called from the kernel, answered from the cache after the first call
def shift():
    return {shift}
"""

KERNEL_EDITED = (
    KEEP_RECORDS
    + """
import affine_ops  # in a file of no module class, as a library's ops are

class UsesTheOp(torch.nn.Module):
    def forward(self, x):
        return torch.ops.precompile_kernel_edit.affine(x).relu()

model = UsesTheOp().eval()
x, y = torch.randn(5, 8), torch.randn(6, 8)
with torch.no_grad():
    whole = precompile.compile_model(
        model, (x,), dynamic={{0: {{0: (2, None)}}}}, cache={cache!r}, warmup=False
    )
    torch.testing.assert_close(whole(y), model(y))
    graph = torch.compile(model, backend=precompile.backend(cache={cache!r}), dynamic=True)
    torch.testing.assert_close(graph(y), model(y))
print("model hit" if any("model cache hit" in r for r in records) else "model miss")
print("graph miss" if any(r.startswith("graph cache miss") for r in records) else "graph hit")
"""
)


def test_an_edited_custom_op_kernel_is_a_miss_never_a_stale_hit(tmp_path: Any) -> None:
    """A custom op's Python kernel (CompositeImplicitAutograd) is traced into the graph,
    whose text names only the op: an edit to its file made the next process's
    ``compile_model`` a hit that ran the old kernel (3.0 where eager gave 4.0). Both the
    model's plan and a graph's key now hold that file, the file the op was registered in,
    and those of what the kernel's global names hold (a helper answered from its
    ``lru_cache`` runs no code a profiler sees), so each edit is a miss for both (the
    asserts inside compare each with eager)."""
    directory = str(tmp_path / "ops")
    os.makedirs(directory)
    script = textwrap.dedent(KERNEL_EDITED.format(directory=directory, cache=str(tmp_path / "c")))

    def write(name: str, text: str) -> None:
        with open(os.path.join(directory, name), "w") as handle:
            handle.write(text)

    write("affine_ops.py", OPS_SOURCE.format(factor=2))
    write("affine_shift.py", SHIFT_SOURCE.format(shift=1.0))
    assert run_python(script).splitlines()[-2:] == ["model miss", "graph miss"]
    assert run_python(script).splitlines()[-2:] == ["model hit", "graph hit"]
    write("affine_ops.py", OPS_SOURCE.format(factor=3))  # the kernel and its registration
    assert run_python(script).splitlines()[-2:] == ["model miss", "graph miss"]
    write("affine_shift.py", SHIFT_SOURCE.format(shift=2.0))  # a cached helper it calls
    assert run_python(script).splitlines()[-2:] == ["model miss", "graph miss"]


FILELESS = (
    KEEP_RECORDS
    + """
import functools

def kept(function):  # a decorator: the wrapper's code is the same whatever it wraps
    @functools.wraps(function)
    def call(*args):
        return function(*args)
    return call

@kept
def act(x):  # a helper the forward calls: defined where no file is, as in a notebook
    return torch.relu(x){shift}

class Scaler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return act(self.proj(x)) * {factor}

torch.manual_seed(0)
model = Scaler().eval()
x = torch.randn(5, 8)
with torch.no_grad():
    compiled = precompile.compile_model(
        model, (x,), dynamic={{0: {{0: (2, None)}}}}, cache={cache!r}, warmup=False
    )
    torch.testing.assert_close(compiled(x), model(x))
print("hit" if any("model cache hit" in r for r in records) else "miss")
print([r for r in records if "stale" in r or "model cache miss" in r][:1])
"""
)


def test_a_kernel_that_reads_a_value_is_refused_with_our_error() -> None:
    """A custom op's Python kernel that turns a tensor into a Python number cannot be
    traced: Dynamo's ``UserError`` ("Could not guard on data-dependent expression") came
    out of ``compile_model`` as itself (a client trial); it is ``UnsupportedGraphError``."""
    library = torch.library.Library("precompile_reads_a_value", "DEF")
    library.define("scaled(Tensor x) -> Tensor")
    library.impl("scaled", lambda x: x * float(x.abs().max()), "CompositeImplicitAutograd")

    class ReadsAValue(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.precompile_reads_a_value.scaled(x) + 1

    try:
        with pytest.raises(precompile.UnsupportedGraphError, match="data-dependent"):
            precompile.compile_model(ReadsAValue(), (torch.randn(4, 8),), cache=False)
    finally:
        library._destroy()


def test_code_defined_without_a_file_is_checked_by_its_code(tmp_path: Any) -> None:
    """A model written in ``python -c`` or a notebook cell has no source file to hash:
    an edit to its forward, or to a helper it calls, was a stale hit in the next process
    (0.89 off eager). The class's functions are now in the key by their code, and the
    traced helpers are checked at load by name (a decorated one by what it wraps: a
    client trial's helper under ``functools.wraps`` was a stale hit 1.73 off eager); the
    same code typed again still hits."""
    cache = str(tmp_path / "cache")

    def run(factor: int, shift: str) -> list[str]:  # run_python runs ``python -c``: no file
        code = FILELESS.format(directory=str(tmp_path), cache=cache, factor=factor, shift=shift)
        return run_python(code).splitlines()[-2:]

    assert run(2, "")[0] == "miss"
    assert run(2, "")[0] == "hit"
    edited_helper = run(2, " + 1")
    assert edited_helper[0] == "miss", edited_helper  # under its decorator, by what it wraps
    assert "<no file: __main__.act.__wrapped__>" in edited_helper[1], edited_helper
    edited_forward = run(3, " + 1")
    assert edited_forward[0] == "miss" and "model_sources" in edited_forward[1], edited_forward


class _Breaks(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: Dynamo breaks the graph here
            return x * 2
        return x - 1


class BranchesOnLength(torch.nn.Module):
    """Twice its input for more than one row, three times for one: Dynamo traces the first
    branch from its lower bound of 2 and records no guard."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 1 else x * 3


class SignAgrees(torch.nn.Module):
    """``relu(x)`` for more than one row, ``abs(x)`` for one: the two sides agree on an
    all-positive example, so a check by running the example narrowed to 1 passed it and
    the traced side ran at 1 (wrong for negative inputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) if x.shape[0] > 1 else torch.abs(x)


@pytest.mark.parametrize("model", [BranchesOnLength(), SignAgrees()], ids=["2x-3x", "sign"])
def test_a_model_that_branches_on_a_dynamic_length_is_served_each_branch_from_its_trace(
    tmp_path: Any, model: torch.nn.Module
) -> None:
    """Before, the default exact size 1 (and the hint variant) ran the traced branch at 1:
    2x where the model returns 3x. Then a run at 1 beside the model refused length 1
    where the two disagreed, and missed branches that agree on the example. Now length 1
    is traced apart, as Dynamo traces it, into the same compiled model; 0 is refused."""
    cache = str(tmp_path)
    example = torch.rand(8, 4) + 0.1  # all positive: the sign branch's sides agree here
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (example,), dynamic={0: [0]}, hints=[8], cache=cache
        )
        found = precompile.compile_model(
            model, (example,), dynamic={0: [0]}, hints=[8], cache=cache, compile=False
        )
        path = str(tmp_path / "branches.pt2c")
        compiled.save(path)
        loaded = precompile.load_model(model, path=path, warmup=False)
        for served in (compiled, found, loaded):
            assert len(served.pieces) == 1
            for rows in (1, 2, 5):
                y = torch.randn(rows, 4)
                torch.testing.assert_close(served(y), model(y))
            with pytest.raises(precompile.NoVariantError, match=r"s[0-9]+ >= 2"):
                served(torch.randn(0, 4))


class SumOfLengths(torch.nn.Module):
    """``x + 1`` where batch + sequence > 3, else ``x - 1``: with both dims traced as 2 or
    more, Dynamo decides it true with no guard; (1, 1), (1, 2), (2, 1) take the other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if x.shape[0] + x.shape[1] > 3 else x - 1


class EmptyAddsOnes(torch.nn.Module):
    """Ones for an empty input, the column sums otherwise: Dynamo decides ``== 0`` false."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(3) + x.sum(0) if x.shape[0] == 0 else x.sum(0)


def test_every_combination_of_lengths_at_1_is_traced_and_0_refused(
    tmp_path: Any,
) -> None:
    """Found by a client trial of the old length-1 check: one length narrowed at a time
    never met (1, 2), where b + s > 3 turns; and 0 was never run (ones were zeros). Each
    combination of lengths at 1 is now a trace of its own; 0 is refused."""
    with torch.no_grad():
        both = precompile.compile_model(
            SumOfLengths(), (torch.randn(3, 8, 2),), dynamic={0: [0, 1]}, hints=[4],
            cache=str(tmp_path / "both"),
        )  # fmt: skip
        empty = precompile.compile_model(
            EmptyAddsOnes(), (torch.randn(8, 3),), dynamic={0: [0]}, hints=[4],
            cache=str(tmp_path / "empty"),
        )  # fmt: skip
    torch.set_grad_enabled(False)  # as compiled: a compiled model checks the grad mode
    try:
        for b, s in ((2, 2), (3, 5), (4, 2), (1, 1), (1, 6), (5, 1)):
            y = torch.randn(b, s, 2)
            torch.testing.assert_close(both(y), SumOfLengths()(y))
        assert sorted(sorted(ones) for ones in both.pieces) == [[0], [0, 1], [1]]
        # the trace at b = 1 (s = 8) guarded 1 + s > 3: (1, 2) would need another trace,
        # which Dynamo would make; here it is refused, never answered from the wrong one
        for b, s in ((0, 3), (2, 0), (1, 2), (2, 1)):
            with pytest.raises(precompile.NoVariantError):
                both(torch.randn(b, s, 2))
        y = torch.randn(5, 3)
        torch.testing.assert_close(empty(y), y.sum(0))
        torch.testing.assert_close(empty(y[:1]), y[:1].sum(0))
        with pytest.raises(precompile.NoVariantError, match=">= 2"):
            empty(torch.randn(0, 3))
    finally:
        torch.set_grad_enabled(True)


class EvenOrOdd(torch.nn.Module):
    """Twice its input for an even number of rows, three times for odd: Dynamo records
    ``Eq(Mod(s, 2), 0)``, which no range says."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] % 2 == 0 else x * 3


def test_a_guard_of_the_trace_that_is_no_range_holds_for_every_variant(tmp_path: Any) -> None:
    """Before, variants kept only the caller's ranges: odd lengths ran the even branch
    (2x for 3x), through compile_model and through a saved standalone_compile artifact
    called directly. Now each variant keeps the trace's guard, and the default exact
    size 1, which breaks it, is not compiled."""
    model = EvenOrOdd()
    graphs: list[Any] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(precompile.standalone_compile(gm, example_inputs, hints=[8], cache=False))
        return gm

    x = torch.randn(4, 3)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (x,), dynamic={0: [0]}, hints=[8], cache=str(tmp_path)
        )
        torch._dynamo.reset()
        torch.compile(model, backend=capture, fullgraph=True)(x)
    graphs[0].save(path=str(tmp_path / "even.pt2c"))
    loaded = precompile.CompiledArtifact.load(path=str(tmp_path / "even.pt2c"))
    assert [v.kind for v in compiled.artifact.manifest.variants] == ["hint"]  # no size 1
    with torch.no_grad():  # as compiled: a compiled model checks the grad mode
        for size in (2, 6, 10):
            y = torch.randn(size, 3)
            torch.testing.assert_close(compiled(y), y * 2)
            torch.testing.assert_close(loaded(size, y)[0], y * 2)
        for size in (3, 7):
            y = torch.randn(size, 3)
            with pytest.raises(precompile.NoVariantError, match=r"Mod|%"):
                compiled(y)
            with pytest.raises(precompile.NoVariantError):
                loaded(size, y)
        y = torch.randn(1, 3)  # traced apart at 1, as Dynamo traces it
        torch.testing.assert_close(compiled(y), y * 3)
        with pytest.raises(precompile.NoVariantError):
            loaded(1, y)


def test_a_graph_break_is_refused_with_dynamos_explanation(tmp_path: Any) -> None:
    with pytest.raises(precompile.UnsupportedGraphError, match="graph break") as info:
        precompile.compile_model(_Breaks(), (torch.randn(4, 8),), cache=str(tmp_path))
    assert "data-dependent" in str(info.value) or "Data-dependent" in str(info.value)


def test_a_kv_cache_output_is_refused_clearly(tmp_path: Any) -> None:
    """A call that makes the model build a DynamicCache itself (use_cache on, by the call
    or by the model's config, and no cache passed) is refused before tracing: the check
    names the call, not the output a whole trace would end at."""
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (1, 5))
    for kwargs in ({"use_cache": True}, {}, {"use_cache": None}):
        with (
            torch.no_grad(),
            pytest.raises(
                precompile.UnsupportedGraphError, match=r"makes a KV cache itself.*DynamicCache"
            ),
        ):
            precompile.compile_model(model, (ids,), kwargs, cache=str(tmp_path))


def test_a_trace_its_own_operations_refuse_is_never_run_compiled(tmp_path: object) -> None:
    """A trace at lengths at 1 that no call of the model's own makes (here the table's
    rows at 1 beside two rows of x, which index it): its graph's operations raise an
    IndexError in eager, and its compiled C++ kernel checks the same bound inside an
    OpenMP region, where a failure ends the process (std::terminate, exit 134). Those
    lengths are refused before they are traced (the model's own forward refuses them: no
    trace, no compile); the model is served elsewhere, and calls at those lengths are
    refused. Run in a child, so a crash fails this test."""
    out = run_python(
        """
        import torch, precompile
        from precompile import _model_trace

        traced = []
        trace_model = _model_trace.trace_model

        def counted(model, args, kwargs, *rest):
            traced.append(tuple(int(a.shape[0]) for a in args))
            return trace_model(model, args, kwargs, *rest)

        _model_trace.trace_model = counted

        class Gather(torch.nn.Module):
            def forward(self, x, table):
                return x * table[torch.arange(x.shape[0])].sum(-1, keepdim=True)

        model = Gather()
        x, table = torch.randn(2, 65536), torch.randn(3, 65536)
        with torch.no_grad():
            compiled = precompile.compile_model(model, (x, table), dynamic={0: [0], 1: [0]})
            # (a sum of 65536 floats in another order: rounding apart)
            torch.testing.assert_close(compiled(x, table), model(x, table), rtol=1e-4, atol=1e-2)
            try:
                compiled(x, table[:1])
            except precompile.NoVariantError as exc:
                print("refused:", exc)
        print("traced:", sorted(traced))
        """,
        env={"PRECOMPILE_CACHE_DIR": str(tmp_path)},
    )
    assert "refused:" in out
    # the example (2 rows of x, 3 of the table), x at 1, both at 1; never x at 2 beside 1
    assert "traced: [(1, 1), (1, 3), (2, 3)]" in out, out


def test_a_hint_past_the_position_table_is_refused_saying_so() -> None:
    """A client trial: hints [8, 64] on a model of 16 positions were refused as if two
    dims had been given different hints; the refusal now names both causes."""

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.table(torch.arange(x.shape[1]))

    with pytest.raises(precompile.UnsupportedGraphError, match=r"dim 1 = 64 .*position table"):
        precompile.compile_model(
            Positions().eval(), (torch.randn(1, 6, 4),), dynamic={0: [1]}, hints=[8, 64],
            cache=False,
        )  # fmt: skip


def test_a_refused_point_prints_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """The traced graph's own operations run before its compiled code; where they refuse
    (an index past a table), that is an answer: no FX traceback on stderr (a compile with
    an attention mask printed two and then succeeded)."""
    from precompile._model import _graph_ops_accept

    class Lookup(torch.nn.Module):
        def forward(self, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return table[index]

    gm = torch.fx.symbolic_trace(Lookup())
    with pytest.raises(precompile.UnsupportedGraphError, match="IndexError"):
        _graph_ops_accept(gm, [torch.randn(4, 2), torch.tensor([7])], set())
    assert "Traceback" not in capfd.readouterr().err


class _ReturnsItsBatch(torch.nn.Module):
    def __init__(self, store: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.store = store
        self.seen = 0

    def forward(self, x: torch.Tensor) -> Any:
        if self.store:
            self.seen = x.shape[0]  # a size kept in an attribute: Dynamo replays it
            return self.lin(x)
        return self.lin(x), x.shape[0], x.size(0) * 2


def test_a_size_returned_or_stored_as_a_python_value_is_refused_where_it_is_dynamic() -> None:
    """A forward returning ``x.shape[0]`` of a dynamic dim was answered with the traced
    example's value at every size (a docs-only client trial: batch 8 gave 3 and 6, in a
    fresh process too): the plan kept plain output values as traced. Dynamo returns such
    a size from the graph, which is now refused at compile time (a size stored in an
    attribute was already: the forward's Python state)."""
    example = torch.randn(3, 4)
    for store, said in ((False, "dynamic size"), (True, r"writes its Python state \(model.seen")):
        model = _ReturnsItsBatch(store).eval()
        with torch.no_grad(), pytest.raises(precompile.UnsupportedGraphError, match=said):
            precompile.compile_model(model, (example,), dynamic={0: [0]}, cache=False)


class _Clamp(torch.nn.Module):
    def forward(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        return x.clamp(max=limit)


class _ReturnsItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> Any:
        return x * self.weight, x


def test_a_nan_argument_and_an_input_returned_as_it_is_are_refused_by_name() -> None:
    """A client trial: a float argument of nan or inf failed in the plan's JSON writer (a
    bare ValueError, after the whole compile); an argument returned as it is was refused
    with a message about KV caches."""
    for value in (float("nan"), float("inf")):
        with pytest.raises(precompile.UnsupportedGraphError, match=r"'limit' is .*finite"):
            precompile.compile_model(_Clamp(), (torch.randn(3, 4),), {"limit": value},
                                     cache=False)  # fmt: skip
    with torch.no_grad(), pytest.raises(precompile.UnsupportedGraphError, match="an argument"):
        precompile.compile_model(_ReturnsItsInput(), (torch.randn(3, 4),), cache=False)


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_module_list_edited_by_del_is_refused_saying_what_to_do() -> None:
    """``del layers[i]`` makes torch rebuild the list's registry as an ``OrderedDict``,
    which the trace read as a ``dict``: the refusal (a client trial: permanent, though
    the modules were the same again) says why and what to do."""
    model = _Blocks().eval()
    with torch.no_grad():
        compiled = precompile.compile_model(model, (torch.randn(3, 4),), dynamic={0: [0]},
                                            cache=False)  # fmt: skip
        model.blocks.append(torch.nn.Linear(4, 4))
        del model.blocks[2]
        with pytest.raises(precompile.IncompatibleArtifactError, match="compile the model again"):
            compiled(torch.randn(5, 4))


def test_compiling_leaves_no_dynamo_mark_on_the_callers_tensors() -> None:
    """``dynamic=`` marked the caller's example tensors for Dynamo and left the marks: a
    later compile of the same tensor naming no dynamic dim traced that dim as dynamic
    (a client trial's finding, read as a build depending on the process's history).
    The caller's own marks stay."""
    model = _Blocks().eval()
    example, marked = torch.randn(3, 4), torch.randn(3, 4)
    torch._dynamo.mark_dynamic(marked, 0)
    own = {k: v for k, v in vars(marked).items() if k.startswith("_dynamo")}
    with torch.no_grad():
        precompile.compile_model(model, (example,), dynamic={0: [0]}, cache=False)
        assert not [k for k in vars(example) if "dynamo" in k]
        precompile.compile_model(model, (marked,), cache=False)
        assert {k: v for k, v in vars(marked).items() if k.startswith("_dynamo")} == own
        static = precompile.compile_model(model, (example,), cache=False)
    with pytest.raises(precompile.InputMismatchError, match="shape"):
        static(torch.randn(5, 4))  # compiled for the example's batch only, as asked


class FixesItsRows(torch.nn.Module):
    """Branches on one exact row count: Dynamo specializes the dim to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] == 3 else x


def test_a_dynamic_dim_the_trace_fixes_is_refused_naming_it() -> None:
    """The refusal says which dim the model's code fixed, in words and in a field
    (``specialized``) a caller such as ``serve_generate`` reads instead of the words."""
    with torch.no_grad(), pytest.raises(precompile.UnsupportedGraphError) as refused:
        precompile.compile_model(FixesItsRows(), (torch.randn(3, 4),), dynamic={0: [0]},
                                 cache=False)  # fmt: skip
    assert "dynamic dim 0 of argument 0 was specialized to 3" in str(refused.value)
    assert refused.value.specialized == ("argument 0", 0)


class ReadsOnlyTheMasksLength(torch.nn.Module):
    """Takes ``x`` up to the mask's length: the mask itself is never read, only its size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x[:, : mask.shape[1]])


def test_a_tensor_read_only_for_its_size_is_served_at_every_size() -> None:
    """Found by a docs-only client trial: an argument the graph takes only as a size
    (``mask.shape[1]``; Dynamo passes the size, not the tensor) was refused at build time
    as "a size that no argument's dims carry". Its size is now read off that argument at
    each call (Dynamo's name for it, ``L['mask'].size()[1]``, says which), its length at 1
    traced apart as any other's; positional and keyword calls."""
    torch.manual_seed(0)
    model = ReadsOnlyTheMasksLength().eval()
    x = torch.randn(2, 10, 8)
    with torch.no_grad():
        for keyword in (False, True):
            args, kwargs = (
                ((x,), {"mask": torch.ones(2, 6)}) if keyword else ((x, torch.ones(2, 6)), {})
            )
            dynamic: dict[int | str, list[int]] = {"mask" if keyword else 1: [1]}
            compiled = precompile.compile_model(model, args, kwargs, dynamic=dynamic,
                                                cache=False)  # fmt: skip
            for length in (6, 3, 9, 1):
                mask = torch.ones(2, length)
                got = compiled(x, mask=mask) if keyword else compiled(x, mask)
                torch.testing.assert_close(got, model(x, mask))


def test_a_trace_failed_by_cpythons_ast_race_is_made_again() -> None:
    """Found in a full CI run: a trace at length 1 failed with ``SystemError: AST
    constructor recursion depth mismatch`` (CPython keeps that depth per interpreter, so
    two threads building ``ast`` trees at once can fail either; Dynamo wrapped it), and
    compile_model refused calls at 1. Such a trace is made again; other errors are not."""
    from precompile import _model

    tries: list[int] = []

    def racing(fails: int, error: BaseException) -> Any:
        def trace() -> str:
            tries.append(1)
            if len(tries) <= fails:
                raise RuntimeError("backend='backend' raised") from error
            return "traced"

        return trace

    race = SystemError("AST constructor recursion depth mismatch (before=297, after=45)")
    assert _model._past_the_ast_race(racing(2, race)) == "traced" and len(tries) == 3
    tries.clear()
    with pytest.raises(RuntimeError):  # the race every time: the last failure stands
        _model._past_the_ast_race(racing(3, race))
    assert len(tries) == 3
    tries.clear()
    with pytest.raises(RuntimeError):  # another error: not made again
        _model._past_the_ast_race(racing(1, SystemError("something else")))
    assert len(tries) == 1
