"""ArtifactCache: layout, digests, quarantine, eviction, ownership, keys, processes, CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from cache_helpers import cache_cli, fake_artifact, get, key_of, put
from conftest import ROOT, Compiled, assert_close, run_fleet, run_python

import precompile
from precompile import _graph_description, _graph_name, _variant_compile
from precompile._cache_key import cache_factors, cache_key
from precompile.cache import ArtifactCache, sha256_hex
from precompile.cache import _store as cache_store
from precompile.runtime import Manifest, Variant
from precompile.runtime.compiler_interface import (
    MemoryPayloads,
    TensorInput,
    current_environment,
)


def test_layout_is_private_tagged_and_versioned(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "c")
    store = ArtifactCache(root)
    assert os.path.isfile(os.path.join(root, "CACHEDIR.TAG"))
    for sub in ("v2", "v2/entries", "v2/blobs"):
        assert os.stat(os.path.join(root, sub)).st_mode & 0o777 == 0o700
    assert store.root == root


def test_root_from_environment(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRECOMPILE_CACHE_DIR", os.path.join(str(tmp_path), "env"))
    assert ArtifactCache().root == os.path.join(str(tmp_path), "env")


def test_put_get_round_trip_and_stats(tmp_path: object) -> None:
    store = ArtifactCache(str(tmp_path))
    art = fake_artifact(1)
    assert get(store, key_of(1)) is None
    put(store, key_of(1), art, {"graph": "g"}, {"aux": b"extra"})
    loaded, aux = get(store, key_of(1))  # type: ignore[misc]
    assert loaded.variants == art.variants
    assert loaded.payload_bytes(art.variants[0].payload) == art.payload_bytes(
        art.variants[0].payload
    )
    assert aux == {"aux": b"extra"}
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 1, 1)


def test_shared_payloads_are_stored_once(tmp_path: object) -> None:
    store = ArtifactCache(str(tmp_path))
    put(store, key_of(1), fake_artifact(1), {})
    put(store, key_of(2), fake_artifact(1), {})
    blobs = [
        f for _, _, files in os.walk(os.path.join(str(tmp_path), "v2", "blobs")) for f in files
    ]
    assert len(blobs) == 1


def _blob_files(root: str) -> list[str]:
    base = os.path.join(root, "v2", "blobs")
    return [os.path.join(d, f) for d, _, files in os.walk(base) for f in files]


@pytest.mark.parametrize("read", ["serial", "threads"])
@pytest.mark.parametrize("damage", ["flip", "truncate-blob", "truncate-entry", "garbage-entry"])
def test_corrupt_entries_are_quarantined_misses(
    tmp_path: object, damage: str, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactCache(str(tmp_path))
    if read == "threads":  # an entry of several blobs read in threads, as large ones are
        monkeypatch.setattr(cache_store, "_PARALLEL_READ_BYTES", 0)
    put(store, key_of(1), fake_artifact(1), {}, {"aux": b"x" * 3000} if read == "threads" else None)
    assert len(_blob_files(str(tmp_path))) == (2 if read == "threads" else 1)
    entry = os.path.join(str(tmp_path), "v2", "entries", key_of(1) + ".json")
    blob = _blob_files(str(tmp_path))[0]
    target = entry if damage.endswith("entry") else blob
    with open(target, "rb") as handle:
        data = bytearray(handle.read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage.startswith("truncate"):
        data = data[: len(data) // 2]
    else:
        data = bytearray(b'{"key": "not this one"}')
    with open(target, "wb") as handle:
        handle.write(bytes(data))
    assert store.get(key_of(1)) is None
    assert not os.path.exists(entry)
    assert os.listdir(os.path.join(str(tmp_path), "v2", "quarantine"))
    assert store.stats().corrupt == 1
    put(store, key_of(1), fake_artifact(1), {})  # a miss can be refilled
    assert get(store, key_of(1)) is not None


def test_a_lazy_get_reads_a_blob_when_it_is_used_and_checks_it_then(tmp_path: object) -> None:
    """What serving loads use (``get(lazy=True)``): the entry's payloads are read when a
    variant needs them, verified then; a corrupt one is refused and its entry quarantined
    (a later compile refills it), a missing one at the get is a miss, and one removed
    after it (another process evicted it) is still read: an entry that loaded keeps its
    bytes until it is dropped (it failed at call time, after a successful load)."""
    from precompile.cache import CorruptArtifactError, VerifiedBlobs

    store = ArtifactCache(str(tmp_path))
    art = fake_artifact(1)
    digest = art.variants[0].payload
    put(store, key_of(1), art, {}, {"aux": b"extra"})
    entry = store.get(key_of(1), lazy=True)
    assert entry is not None and isinstance(entry.blobs, VerifiedBlobs)
    assert entry.aux == {"aux": b"extra"} and list(entry.blobs) == [digest]
    (payload_blob,) = [f for f in _blob_files(str(tmp_path)) if os.path.basename(f) == digest]
    with open(payload_blob, "rb") as handle:
        good = handle.read()
    with open(payload_blob, "wb") as handle:
        handle.write(good[: len(good) // 2])
    with pytest.raises(CorruptArtifactError, match=digest[:12]):
        entry.blobs[digest]
    with pytest.raises(CorruptArtifactError, match="was quarantined when a read of it found"):
        entry.blobs[digest]  # asked again: the blob is gone, and the error says why
    assert store.get(key_of(1)) is None and store.stats().corrupt == 1  # quarantined
    put(store, key_of(1), art, {}, {"aux": b"extra"})
    entry = store.get(key_of(1), lazy=True)
    assert entry is not None
    (payload_blob,) = [f for f in _blob_files(str(tmp_path)) if os.path.basename(f) == digest]
    os.remove(payload_blob)  # evicted by another process after the load
    assert entry.blobs[digest] == art.payload_bytes(digest)
    assert store.get(key_of(1), lazy=True) is None  # missing at the get: a miss
    put(store, key_of(1), art, {}, {"aux": b"extra"})
    loaded, _ = get(store, key_of(1))  # type: ignore[misc]
    assert loaded.payload_bytes(digest) == art.payload_bytes(digest)


def test_a_lazy_entry_holds_no_descriptor_once_read_or_dropped(tmp_path: object) -> None:
    """The descriptors that keep a loaded entry's blobs readable are closed once each
    blob is read, and when an entry whose blobs were never read is dropped."""
    import gc

    store = ArtifactCache(str(tmp_path))
    art = fake_artifact(1)
    put(store, key_of(1), art, {})
    before = len(os.listdir("/proc/self/fd"))
    entry = store.get(key_of(1), lazy=True)
    assert entry is not None and len(os.listdir("/proc/self/fd")) == before + 1
    entry.blobs[art.variants[0].payload]
    assert len(os.listdir("/proc/self/fd")) == before
    entry = store.get(key_of(1), lazy=True)
    del entry
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_payload_limit_below_an_entry_refuses_it_and_loses_nothing(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy entry over ``PRECOMPILE_MAX_PAYLOAD_BYTES`` is refused naming the limit,
    not quarantined as corrupt (found by a client trial: the entry was destroyed)."""
    store = ArtifactCache(str(tmp_path))
    put(store, key_of(1), fake_artifact(1), {})
    monkeypatch.setenv("PRECOMPILE_MAX_PAYLOAD_BYTES", "10")
    with pytest.raises(precompile.PayloadLimitError, match="PRECOMPILE_MAX_PAYLOAD_BYTES"):
        get(store, key_of(1))
    assert store.contains(key_of(1)) and store.stats().corrupt == 0
    monkeypatch.delenv("PRECOMPILE_MAX_PAYLOAD_BYTES")
    assert get(store, key_of(1)) is not None


def test_entries_writable_by_others_are_refused_unless_trusted(tmp_path: object) -> None:
    store = ArtifactCache(str(tmp_path))
    put(store, key_of(1), fake_artifact(1), {})
    entry = os.path.join(str(tmp_path), "v2", "entries", key_of(1) + ".json")
    os.chmod(entry, 0o666)
    with pytest.raises(precompile.UnsafeCacheError, match="writable by group/others") as info:
        get(store, key_of(1))
    assert isinstance(info.value, PermissionError)
    assert ArtifactCache(str(tmp_path), trust_foreign=True).get(key_of(1)) is not None


def test_eviction_keeps_cache_under_limit_lru_first(tmp_path: object) -> None:
    store = ArtifactCache(str(tmp_path), size_limit=10**9)
    for n in range(4):
        put(store, key_of(n), fake_artifact(n, size=50_000), {})
    get(store, key_of(0))  # touch: 0 is now the most recently used
    os.utime(os.path.join(str(tmp_path), "v2", "entries", key_of(0) + ".json"))
    per_entry = store.total_size() / 4
    evicted = store.prune(int(per_entry * 2.5)).evicted
    assert evicted == (key_of(1), key_of(2))
    assert store.total_size() <= per_entry * 2.5
    assert {e.key for e in store.entries()} == {key_of(0), key_of(3)}
    assert len(_blob_files(str(tmp_path))) == 2  # evicted entries' blobs are gone too
    assert store.stats().evictions == 2
    small = ArtifactCache(str(tmp_path), size_limit=int(per_entry * 1.5))
    put(small, key_of(9), fake_artifact(9, size=50_000), {})
    assert [e.key for e in small.entries()] == [key_of(9)]  # the new entry survives


def _factors(mlp: Compiled, **change: object) -> dict[str, str]:
    captured = mlp.captured
    graph = _graph_description.describe_graph(captured.gm, captured.example_inputs, "from_graph")
    from precompile._variant_plan import plan_variants

    hints = change.get("hints", [1, 16])
    requests = plan_variants(["s77"], {}, [5], hints=hints, sizes=None)  # type: ignore[arg-type]
    options = change.get("options", {})
    return cache_factors(captured.gm, graph, requests, options, "from_graph", "cpu")  # type: ignore[arg-type]


def test_key_changes_with_what_changes_code(mlp: Compiled, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _factors(mlp)
    assert cache_key(_factors(mlp)) == cache_key(base)
    assert cache_key(_factors(mlp, hints=[1, 32])) != cache_key(base)
    opts = {"config_patches": {"max_autotune": True}}
    assert cache_key(_factors(mlp, options=opts)) != cache_key(base)
    from precompile import _cache_key

    env = current_environment("cpu")
    monkeypatch.setattr(
        _cache_key, "current_environment", lambda d: dataclasses.replace(env, torch="9.9.9")
    )
    changed = _factors(mlp)
    assert cache_key(changed) != cache_key(base)
    monkeypatch.undo()
    from conftest import AttentionBlock, capture

    other = capture(AttentionBlock().eval(), torch.randn(2, 3, 32))
    graph = _graph_description.describe_graph(other.gm, other.example_inputs, "from_graph")
    assert cache_factors(other.gm, graph, [], {}, "from_graph", "cpu")["graph"] != base["graph"]


def test_attention_lengths_are_pinned_only_where_guards_hold_them() -> None:
    """A length is fixed in a variant where its guards hold it to one value."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv(specialize_zero_one=False, duck_shape=False)
    own = [
        env.create_symbol(1, source=ConstantSource(f"v{i}"), dynamic_dim=DimDynamic.DYNAMIC)
        for i in range(2)
    ]
    caller = [sympy.Symbol("s0", integer=True), sympy.Symbol("s1", integer=True)]
    reverse = dict(zip(own, caller, strict=True))
    env.evaluate_expr(sympy.Eq(own[0], 1))
    assert _variant_compile._lengths_pinned(env, reverse, [caller[0], sympy.Integer(8)])
    assert not _variant_compile._lengths_pinned(env, reverse, [caller[1]])
    assert not _variant_compile._lengths_pinned(env, reverse, [sympy.Symbol("u0")])


class _CacheAttention(torch.nn.Module):
    """Attention of x's positions over a fixed-length memory, as a decode step attends
    over a static KV cache: the key length is fixed, the query length is x's."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.register_buffer("memory", torch.randn(1, 2, 8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q = self.proj(x).reshape(batch, seq, 2, 16).transpose(1, 2)
        kv = self.memory.expand(batch, 2, 8, 16)
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv)
        return out.transpose(1, 2).reshape(batch, seq, width)


def test_cudnn_attention_only_where_a_variants_attention_lengths_are_fixed(
    mlp: Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN attention builds a plan per shape at its first call. A hint variant whose
    attention lengths vary (prefill) is compiled with it off; one whose lengths are fixed
    (a decode step: only the batch varies) keeps the caller's switches; a variant that
    could be fixed but whose guards leave a length free is compiled again without it.
    The switches are restored after; PRECOMPILE_CUDNN_ATTENTION (auto/1/0) is a key
    factor."""
    import torch._inductor.compile_fx as compile_fx_module

    from precompile import _attention_policy
    from precompile.runtime import InvalidOptionError

    real = compile_fx_module.compile_fx
    seen: list[bool] = []
    stop = [True]

    class Stop(Exception):
        pass

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if stop[0]:
            raise Stop
        return real(*args, **kwargs)

    def variants(captured: Any, point_of: dict[str, int], dynamic: bool = True) -> list[bool]:
        seen.clear()
        graph = _graph_description.describe_graph(captured.gm, captured.example_inputs, "g")
        point = {s: point_of.get(str(s), 16) for s in graph.symbols}
        with contextlib.suppress(Stop):
            _variant_compile.compile_variant(captured.gm, graph, point, dynamic=dynamic, options={})
        return list(seen)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    monkeypatch.setattr(_variant_compile, "graph_on_cuda", lambda graph: True)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert before, "cuDNN attention is on by default"
    from conftest import capture

    decode = capture(_CacheAttention().eval(), torch.randn(2, 1, 32))  # length 1: fixed
    prefill = capture(_CacheAttention().eval(), torch.randn(2, 4, 32))
    assert _variant_compile.attention_lengths(decode.gm) == (1, 8)
    lengths = _variant_compile.attention_lengths(prefill.gm)
    assert lengths is not None
    (query, key) = lengths
    assert query.free_symbols and key == 8
    assert variants(decode, {}) == [True]
    assert variants(prefill, {}) == [False]  # the query length varies
    assert variants(prefill, {}, dynamic=False) == [True]  # one shape: the caller's switches
    stop[0] = False
    # At length 1 the length can be fixed; the compile's guards hold it there (one
    # compile), and where they would leave it free the variant is compiled again.
    assert variants(prefill, {str(query): 1}) == [True]
    monkeypatch.setattr(_variant_compile, "_lengths_pinned", lambda *args: False)
    assert variants(prefill, {str(query): 1}) == [True, False]
    monkeypatch.undo()
    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    monkeypatch.setattr(_variant_compile, "graph_on_cuda", lambda graph: True)
    stop[0] = True
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    base = cache_key(_factors(mlp))
    monkeypatch.setenv(_attention_policy.CUDNN_ATTENTION_ENV, "1")
    assert variants(prefill, {}) == [True]
    assert cache_key(_factors(mlp)) != base
    monkeypatch.setenv(_attention_policy.CUDNN_ATTENTION_ENV, "0")
    assert variants(decode, {}) == [False]
    monkeypatch.setenv(_attention_policy.CUDNN_ATTENTION_ENV, "sometimes")
    with pytest.raises(InvalidOptionError, match="PRECOMPILE_CUDNN_ATTENTION"):
        variants(decode, {})


def test_model_key_changes_with_inductor_config() -> None:
    """A model compiled under other inductor settings is a miss, never their code."""
    from torch._inductor import config as inductor_config

    from precompile._cache_key import model_factors

    model = torch.nn.Linear(4, 4).eval()
    x = torch.randn(3, 4)
    base = model_factors(model, (x,), {}, {0: {0}}, [8], [1], {})
    assert model_factors(model, (x,), {}, {0: {0}}, [8], [1], {}) == base
    with inductor_config.patch(max_autotune=True):
        changed = model_factors(model, (x,), {}, {0: {0}}, [8], [1], {})
    assert changed["codegen_config"] != base["codegen_config"]


def test_key_ignores_path_pid_and_time(mlp: Compiled, tmp_path: object) -> None:
    here = cache_key(_factors(mlp))
    code = f"""
        import os, sys, time
        sys.path.insert(0, "tests")
        os.environ["PRECOMPILE_CACHE_DIR"] = {str(tmp_path)!r}
        time.sleep(1.1)
        import torch
        from conftest import MLP, capture
        from precompile._cache_key import cache_factors, cache_key
        from precompile._graph_description import describe_graph
        from precompile._variant_plan import plan_variants
        torch.manual_seed(0)
        captured = capture(MLP(width=32, hidden=64).eval(), torch.randn(5, 32))
        graph = describe_graph(captured.gm, captured.example_inputs, "from_graph")
        requests = plan_variants(["s77"], {{}}, [5], hints=[1, 16], sizes=None)
        print(cache_key(cache_factors(captured.gm, graph, requests, {{}}, "from_graph", "cpu")))
    """
    assert run_python(code).strip().splitlines()[-1] == here


def test_second_compile_is_a_hit_and_compiles_nothing(
    mlp: Compiled, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    captured = mlp.captured
    store = ArtifactCache(str(tmp_path))
    with torch.no_grad():
        first = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=store
        )

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled on a cache hit")

    monkeypatch.setattr(_variant_compile, "compile_variant", refuse)
    with torch.no_grad():
        second = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=str(tmp_path)
        )
        x = torch.randn(40, 32)
        assert_close(second(*captured.flat(x)), captured.model(x))
    assert second.variants == first.variants
    assert ArtifactCache(str(tmp_path)).stats().hits == 1
    # The failure is remembered per process: keep it out of the other tests' memory.
    from precompile import _standalone

    monkeypatch.setattr(_standalone, "_FAILED", {})
    with pytest.raises(precompile.UnsupportedGraphError, match="compiled on a cache hit"):
        precompile.standalone_compile(captured.gm, captured.example_inputs, hints=[16], cache=False)


BACKEND_SCRIPT = """
    import os, sys
    sys.path.insert(0, "tests")
    import torch, torch._inductor.graph as graph
    lowerings = []
    original = graph.GraphLowering.__init__
    def counting(self, *a, **k):
        lowerings.append(1)
        original(self, *a, **k)
    graph.GraphLowering.__init__ = counting
    import precompile
    from conftest import MLP
    torch.manual_seed(0)
    model = MLP(width=32, hidden=64).eval()
    compiled = torch.compile(model, backend=precompile.backend(hints=[4, 64]), dynamic=True)
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        for n in [5, 3, 17, 100]:
            x = torch.randn(n, 32)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    print("lowerings", len(lowerings))
"""


def test_backend_warm_starts_a_second_process_with_zero_compiles(tmp_path: object) -> None:
    env = {"PRECOMPILE_CACHE_DIR": str(tmp_path)}
    first = run_python(BACKEND_SCRIPT, env=env)
    second = run_python(BACKEND_SCRIPT, env=env)
    assert "lowerings 0" not in first
    assert second.strip().splitlines()[-1] == "lowerings 0"


SINGLE_FLIGHT_SCRIPT = """
with torch.no_grad():
    art = precompile.standalone_compile(captured.gm, captured.example_inputs, hints=[8, 128])
    x = torch.randn(50, 32)
    torch.testing.assert_close(art(*captured.flat(x))[0], model(x), rtol=1e-4, atol=1e-4)
print("compiles", len(compiles))
"""


def test_four_processes_cold_start_one_key_and_exactly_one_compiles(tmp_path: object) -> None:
    root = str(tmp_path)
    env = {"PRECOMPILE_CACHE_DIR": os.path.join(root, "cache")}
    outputs = run_fleet(SINGLE_FLIGHT_SCRIPT, [[]] * 4, os.path.join(root, "ready"), env=env)
    counts = sorted(int(out.strip().splitlines()[-1].split()[1]) for out in outputs)
    assert counts == [0, 0, 0, 2]  # one process compiled both variants, three loaded them


KILL_SCRIPT = """
    import os, signal, sys
    sys.path.insert(0, "tests")
    from precompile.cache import ArtifactCache, _store
    from cache_helpers import fake_artifact, key_of, put
    store = ArtifactCache(sys.argv[1])
    original = _store.ArtifactCache._write_blob
    def write_then_die(self, digest, raw):
        original(self, digest, raw)
        os.kill(os.getpid(), signal.SIGKILL)
    _store.ArtifactCache._write_blob = write_then_die
    put(store, key_of(7), fake_artifact(7), {})
"""


def test_process_killed_mid_save_leaves_no_entry_that_loads(tmp_path: object) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILL_SCRIPT), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == -signal.SIGKILL
    store = ArtifactCache(str(tmp_path))
    assert get(store, key_of(7)) is None
    assert store.entries() == []
    assert len(_blob_files(str(tmp_path))) == 1  # an orphan, collected by prune later
    put(store, key_of(7), fake_artifact(7), {})
    assert get(store, key_of(7)) is not None


def test_cli_commands(tmp_path: object) -> None:
    root = str(tmp_path)
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {"graph": "a", "device": "cpu"})
    put(store, key_of(2), fake_artifact(2), {"graph": "b", "device": "cpu"})
    listing = cache_cli("--root", root, "ls")
    assert listing.returncode == 0 and key_of(1)[:12] in listing.stdout
    entries = json.loads(cache_cli("--root", root, "ls", "--json").stdout)
    assert {e["key"] for e in entries} == {key_of(1), key_of(2)}
    info = json.loads(cache_cli("--root", root, "info", key_of(1)[:10], "--json").stdout)
    assert info["factors"]["graph"] == "a"
    assert "differs in: graph" in cache_cli("--root", root, "explain", key_of(1)[:10]).stdout
    assert cache_cli("--root", root, "verify").returncode == 0
    stats = json.loads(cache_cli("--root", root, "stats", "--json").stdout)
    assert stats["entries"] == 2
    planned = json.loads(
        cache_cli("--root", root, "prune", "--max-size", "1", "--dry-run", "--json").stdout
    )
    assert planned["dry_run"] and len(planned["evicted"]) == 2 and planned["bytes_freed"] > 0
    assert len(json.loads(cache_cli("--root", root, "ls", "--json").stdout)) == 2  # nothing went
    pruned = cache_cli("--root", root, "prune", "--max-size", "1", "--json")
    assert json.loads(pruned.stdout)["evicted"]
    assert cache_cli("--root", root, "clear").returncode != 0  # needs --yes
    assert cache_cli("--root", root, "clear", "--yes").returncode == 0
    assert json.loads(cache_cli("--root", root, "ls", "--json").stdout) == []


def test_cli_exit_codes_and_reads_that_change_nothing(tmp_path: object) -> None:
    """``--help`` says errors exit 2 and a failed check 1: a missing entry or file is an
    error; a command that reads creates no cache where there is none; ``verify`` leaves a
    corrupt entry in place unless told ``--quarantine``; a negative ``--max-size`` is
    refused (it planned to evict everything)."""
    missing = os.path.join(str(tmp_path), "none")
    for action in ("ls", "stats", "tags", "verify"):
        result = cache_cli("--root", missing, action)
        assert result.returncode == 0 and "no cache at" in result.stdout, result
    for action in ("info", "explain"):
        result = cache_cli("--root", missing, action, "0" * 12)
        assert result.returncode == 2 and "no cache at" in result.stderr, result
    assert not os.path.exists(missing)
    root = os.path.join(str(tmp_path), "c")
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {"graph": "a", "device": "cpu"})
    result = cache_cli("--root", root, "info", "0" * 12)
    assert result.returncode == 2 and "no entry's key starts with" in result.stderr
    result = cache_cli("--root", root, "prune", "--max-size", "-5", "--dry-run")
    assert result.returncode == 2 and "expected a number of bytes >= 0" in result.stderr
    files = subprocess.run(
        [sys.executable, "-m", "precompile", "verify", os.path.join(root, "no-such.pt2c")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert files.returncode == 2 and "no artifact at" in files.stderr
    assert "Errno" not in files.stderr
    # a key file that cannot be read is an error (2), not a failed check (1); signing
    # reads it before anything else, and finds no cache where there is none
    no_key = os.path.join(str(tmp_path), "no-such.pem")
    unread = subprocess.run(
        [sys.executable, "-m", "precompile", "verify", "--key", no_key, "x.pt2c"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert unread.returncode == 2 and "cannot read key file" in unread.stderr, unread
    for where in (missing, root):
        signed = cache_cli("--root", where, "sign", "--key", no_key)
        assert signed.returncode == 2 and "cannot read key file" in signed.stderr, signed
    assert not os.path.exists(missing)
    blobs = os.path.join(root, "v2", "blobs")
    blob = next(os.path.join(d, f) for d, _, fs in os.walk(blobs) for f in fs)
    with open(blob, "r+b") as handle:
        handle.seek(10)
        byte = handle.read(1)
        handle.seek(10)
        handle.write(bytes([byte[0] ^ 0xFF]))
    quarantine = os.path.join(root, "v2", "quarantine")
    checked = cache_cli("--root", root, "verify")
    assert checked.returncode == 1 and "1 corrupt, left in place" in checked.stdout
    assert not os.listdir(quarantine) and store.contains(key_of(1))
    moved = cache_cli("--root", root, "verify", "--quarantine")
    assert moved.returncode == 1 and "moved to quarantine" in moved.stdout
    assert os.listdir(quarantine) and not store.contains(key_of(1))


def test_cli_counts_and_odd_input(tmp_path: object) -> None:
    """From a client trial: ``cache verify`` counted an unreadable entry file against the
    intact ones ("checked 8 entries: 7 intact" where 8 of 9 were intact); a dry run on a
    missing cache made its layout; ``clear`` without ``--yes`` exited 1; ``--max-size``
    took " 5", "1_000" and "+5"."""
    root = os.path.join(str(tmp_path), "c")
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {})
    put(store, key_of(2), fake_artifact(2), {})
    with open(os.path.join(root, "v2", "entries", key_of(3) + ".json"), "w") as handle:
        handle.write("x")
    checked = cache_cli("--root", root, "verify")
    assert checked.returncode == 1
    assert "checked 3 entries: 2 intact, 1 could not be checked" in checked.stdout, checked
    missing = os.path.join(str(tmp_path), "none")
    for args in (("prune", "--dry-run"), ("clear", "--dry-run")):
        assert cache_cli("--root", missing, *args).returncode == 0
    refused = cache_cli("--root", missing, "clear")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert cache_cli("--root", root, "clear").returncode == 2
    assert not os.path.exists(missing)
    for odd in (" 5", "1_000", "+5", "5.0"):
        result = cache_cli("--root", root, "prune", "--max-size", odd, "--dry-run")
        assert result.returncode == 2 and "expected a number of bytes" in result.stderr, odd


def test_cli_ls_fits_the_terminal(tmp_path: object) -> None:
    """``cache ls`` cuts its WHAT and INPUTS columns to ``$COLUMNS`` (it printed 235
    columns whatever the terminal)."""
    root = str(tmp_path)
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {"device": "cpu"}, about={"graph": "g" * 150})
    wide = subprocess.run(
        [sys.executable, "-m", "precompile", "cache", "--root", root, "ls"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    assert wide.returncode == 0, wide.stderr
    row = next(line for line in wide.stdout.splitlines() if line.startswith(key_of(1)[:12]))
    assert len(row) <= 100 and "..." in row, row


def test_cli_ls_shows_what_is_unknown_as_unknown(tmp_path: object) -> None:
    """Entries written before ``about`` was recorded, documents this version cannot read,
    and an ``about`` with terminal control characters: all listed, none crashes."""
    root = str(tmp_path)
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {"device": "cpu:old"})  # no about, as before
    store.put(key_of(2), {"format": "precompile-artifact", "format_version": 99}, {}, {})
    model = {"kind": "precompile-model", "manifest": None, "model": {"model_class": "m.Net"}}
    store.put(key_of(3), model, {}, {"device": "cuda:X"}, about={"config": "evil\x1b[2Jtext"})
    with pytest.raises(precompile.InvalidOptionError, match="about must map"):
        store.put(key_of(4), None, {}, {}, about={"graph": 3})  # type: ignore[dict-item]
    digest = sha256_hex(b"static")  # a graph with no dynamic dim: one variant, point {}
    static = Manifest(
        environment=current_environment("cpu"),
        symbols=(),
        inputs=(TensorInput("float32", "cpu", (1, 4)),),
        variants=(Variant(0, "hint", {}, (), digest, digest),),
    )
    put(
        store,
        key_of(5),
        precompile.CompiledArtifact(static, MemoryPayloads({digest: b"static"})),
        {},
    )
    listing = cache_cli("--root", root, "ls")
    assert listing.returncode == 0, listing.stderr
    rows = {line[:12]: line.split("  ") for line in listing.stdout.splitlines()}
    cells = {k: [c.strip() for c in row if c.strip()] for k, row in rows.items()}
    assert cells[key_of(1)[:12]][1:5] == ["graph ?", "f32[s0, 4]", "hints s0=8", "cpu:old"]
    assert cells[key_of(2)[:12]][1:5] == ["?", "?", "?", "?"]
    assert cells[key_of(3)[:12]][1:5] == ["model Net (evil?[2Jtext)", "?", "?", "cuda:X"]
    assert cells[key_of(5)[:12]][3] == "static"  # was "hints ()"
    assert "\x1b" not in listing.stdout and "4 entries" in listing.stdout
    listed = {e["key"]: e for e in json.loads(cache_cli("--root", root, "ls", "--json").stdout)}
    assert listed[key_of(1)]["kind"] == "graph" and listed[key_of(1)]["name"] is None
    assert listed[key_of(1)]["hints"] == [{"s0": 8}] and listed[key_of(1)]["about"] == {}
    assert listed[key_of(2)]["kind"] == "unknown" and listed[key_of(2)]["inputs"] is None
    assert listed[key_of(3)]["name"] == "m.Net" and listed[key_of(3)]["config"].startswith("evil")
    assert listed[key_of(5)]["hints"] == [] and listed[key_of(5)]["sizes"] == []
    missing = cache_cli("--root", root, "explain", "f" * 64)  # said "matches 0 entries; give more"
    assert missing.returncode != 0 and "no entry's key starts with 'ffff" in missing.stderr


def test_miss_explanation_names_the_differing_factor(tmp_path: object) -> None:
    store = ArtifactCache(str(tmp_path))
    put(store, key_of(1), fake_artifact(1), {"graph": "a", "torch": "2.13"})
    explanation = store.explain_miss(key_of(2), {"graph": "a", "torch": "2.14"})
    assert explanation.nearest == key_of(1)
    assert explanation.differing == ("torch",)


HOLDER_SCRIPT = """
    import os, signal, sys
    from precompile.cache import ArtifactCache
    store = ArtifactCache(sys.argv[1])
    with store.lock(sys.argv[2]):
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_crashed_lock_holder_does_not_block_others(tmp_path: object) -> None:
    import time

    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HOLDER_SCRIPT), str(tmp_path), key_of(3)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "holding" in result.stdout and result.returncode == -signal.SIGKILL
    from precompile._standalone import _cached_or_built

    store = ArtifactCache(str(tmp_path), lock_timeout=5)
    started = time.monotonic()
    built = []

    def build() -> tuple[precompile.CompiledArtifact, list[object]]:
        built.append(1)
        return fake_artifact(3), []

    _cached_or_built(store, key_of(3), {}, build)  # type: ignore[arg-type]
    assert built == [1] and time.monotonic() - started < 5
    assert get(store, key_of(3)) is not None


def test_kernel_blobs_are_kept_while_their_entry_lives(mlp: Compiled, tmp_path: object) -> None:
    # Eviction drops unreferenced blobs at once: the kernels of a kept entry must count
    # as referenced, or the entry would lose its .so files and fail its next load.
    store = ArtifactCache(str(tmp_path))
    assert mlp.artifact.manifest.kernel_digests
    put(store, key_of(1), mlp.artifact, {"graph": "mlp"})
    put(store, key_of(2), fake_artifact(2), {"graph": "other"})
    os.utime(store.entry_path(key_of(1)), (1e9, 1e9))
    os.utime(store.entry_path(key_of(2)), (1e9 + 1, 1e9 + 1))  # 1 is least recent
    size_of_1 = next(e.size for e in store.entries() if e.key == key_of(1))
    plan = store.prune(size_limit=store.total_size() - 1, keep=key_of(1))
    assert plan.evicted == (key_of(2),)
    assert next(e.size for e in store.entries() if e.key == key_of(1)) == size_of_1
    loaded, _ = get(store, key_of(1))  # type: ignore[misc]
    for digest in mlp.artifact.manifest.kernel_digests:
        assert loaded.payload_bytes(digest) == mlp.artifact.payload_bytes(digest)


def test_tags_name_entries_for_servers(tmp_path: object) -> None:
    store = ArtifactCache(str(tmp_path))
    with pytest.raises(precompile.ArtifactNotFoundError, match="tagged 'model'"):
        precompile.CompiledArtifact.load(tag="model", cache=store)
    put(store, key_of(1), fake_artifact(1), {"graph": "g"})
    store.tag("model", key_of(1))
    assert store.tags() == {"model": key_of(1)}
    loaded = precompile.CompiledArtifact.load(tag="model", cache=store)
    assert loaded.cache_key == key_of(1)
    # the cache as a path, as compile functions take it, reads the same entry
    by_path = precompile.CompiledArtifact.load(tag="model", cache=str(tmp_path))
    assert by_path.cache_key == key_of(1)
    with pytest.raises(precompile.InvalidOptionError, match="needs a cache"):
        precompile.CompiledArtifact.load(tag="model", cache=False)
    store.tag("model", key_of(2))  # retagging replaces; a tag of a missing entry misses
    with pytest.raises(precompile.ArtifactNotFoundError, match="no intact entry"):
        precompile.CompiledArtifact.load(tag="model", cache=store)
    for bad in ["", "../escape", ".hidden", "a/b", "x" * 101]:
        with pytest.raises(precompile.InvalidOptionError, match="tag name"):
            store.tag(bad, key_of(1))
    with pytest.raises(precompile.InvalidOptionError, match="sha256"):
        store.tag("model", "not-a-key")
    out = cache_cli("--root", str(tmp_path), "tags", "--json").stdout
    assert json.loads(out) == {"model": key_of(2)}
    # a tag file damaged on disk is said to be, not "no entry is tagged" (a client trial)
    tag_file = os.path.join(str(tmp_path), "v2", "tags", "model")
    for damage in ("\x00garbage", key_of(1)[:12]):
        with open(tag_file, "w") as handle:
            handle.write(damage)
        with pytest.raises(precompile.CorruptArtifactError, match=r"tag 'model' .* damaged"):
            precompile.CompiledArtifact.load(tag="model", cache=store)


@pytest.mark.parametrize("damage", ["fifo", "directory", "symlink", "oversized"])
def test_a_blob_that_is_no_blob_is_moved_away_so_a_refill_heals(
    tmp_path: object, damage: str
) -> None:
    """A blob path holding a FIFO, a directory, a link (even to the right bytes) or a
    file past its bound is refused and moved to quarantine with its entry: the compile
    that refills the entry writes the blob again, and the next load is whole."""
    store = ArtifactCache(str(tmp_path))
    art = fake_artifact(1)
    put(store, key_of(1), art, {})
    (blob,) = _blob_files(str(tmp_path))
    with open(blob, "rb") as handle:
        good = handle.read()
    os.remove(blob)
    if damage == "fifo":
        os.mkfifo(blob)
    elif damage == "directory":
        os.mkdir(blob)
    elif damage == "symlink":
        copy = os.path.join(str(tmp_path), "copy")
        with open(copy, "wb") as handle:
            handle.write(good)
        os.symlink(copy, blob)
    else:
        with open(blob, "wb") as handle:
            handle.write(good)
        os.truncate(blob, 64 << 20)
    assert store.get(key_of(1)) is None  # a miss, the entry quarantined
    assert not os.path.lexists(blob)
    put(store, key_of(1), art, {})
    loaded, _ = get(store, key_of(1))  # type: ignore[misc]
    digest = art.variants[0].payload
    assert loaded.payload_bytes(digest) == art.payload_bytes(digest)


def test_get_or_build_is_one_protocol(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache layer's get-or-build, which ``standalone_compile`` and ``compile_model``
    both go through: a hit never builds; a miss builds once, with the store, and saves;
    offline refuses before any build (a hit still serves); a cache that cannot store, or
    cannot take a lock, costs the cache and never the build."""
    from precompile.cache import CacheWriteError, get_or_build

    store = ArtifactCache(str(tmp_path / "c"))
    saved: dict[str, str] = {}
    built: list[object] = []

    def build(into: ArtifactCache | None) -> str:
        built.append(into)
        return f"built-{len(built)}"

    def save(into: ArtifactCache, value: str) -> None:
        saved[key_of(1)] = value

    def get(**options: Any) -> str:
        arguments: dict[str, Any] = {"load": lambda s: saved.get(key_of(1)), "build": build,
                                     "save": save, **options}  # fmt: skip
        return get_or_build(store, key_of(1), {"graph": "g"}, **arguments)

    class Offline(LookupError):
        pass

    def refuse() -> Any:
        raise Offline("compiling is off")

    with pytest.raises(Offline):
        get(refuse=refuse)
    assert built == [] and saved == {}
    assert get() == "built-1" and built == [store] and saved == {key_of(1): "built-1"}
    assert get() == "built-1" and get(refuse=refuse) == "built-1" and len(built) == 1

    def cannot_save(into: ArtifactCache, value: str) -> None:
        raise CacheWriteError("disk full")

    saved.clear()
    assert get(save=cannot_save) == "built-2" and saved == {}

    def no_lock(key: str) -> Any:
        raise CacheWriteError("read-only")

    monkeypatch.setattr(store, "lock", no_lock)
    assert get() == "built-3" and built[-1] is None and saved == {}
    built.clear()
    assert get_or_build(None, key_of(1), {}, load=lambda s: "never", build=build,
                        save=save) == "built-1" and built == [None]  # fmt: skip
    with pytest.raises(Offline):
        get_or_build(None, key_of(1), {}, load=lambda s: None, build=build, save=save,
                     refuse=refuse)  # fmt: skip


def test_a_captured_graph_is_named_after_its_model() -> None:
    """``cache ls`` says what an entry is: a graph from ``capture_graph`` is named after the
    model's own ``forward`` (or the function), never torch's wrapper around it."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    sequential = torch.nn.Sequential(torch.nn.Linear(4, 4))
    gm, _ = precompile.capture_graph(sequential, torch.randn(2, 4), dynamic=True)
    assert _graph_name.graph_name(gm).startswith("Sequential.forward (container.py:")
    gm, _ = precompile.capture_graph(scaled, torch.randn(2, 4))
    assert _graph_name.graph_name(gm).startswith("test_a_captured_graph_is_named_after_its")
    assert "(test_cache.py:" in _graph_name.graph_name(gm)


def test_verify_counts_an_entry_file_that_is_no_entry(tmp_path: object) -> None:
    """``verify`` counts every entry file it found (docs/cache.md): a ``.json`` file put
    in ``entries/`` by hand, named by no cache key, was skipped without a word (a client
    trial). It is reported as unreadable, and never read."""
    store = ArtifactCache(str(tmp_path))
    put(store, key_of(1), fake_artifact(1), {"graph": "g"})
    stray = os.path.join(str(tmp_path), "v2", "entries", "notakey.json")
    with open(stray, "w") as handle:
        handle.write("{}")
    report = store.verify()
    assert report.checked == 2 and report.intact == 1 and report.corrupt == ()
    assert [path for path, _ in report.unreadable] == [stray]
    assert "not a cache key" in report.unreadable[0][1]
    assert [e.key for e in store.entries()] == [key_of(1)]
