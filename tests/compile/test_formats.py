"""Saving and loading: both formats, fresh processes, corruption, foreign and stale files."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

import pytest
import torch
from conftest import Compiled, assert_close, run_python

import precompile
from precompile.runtime._binary_format import write_binary
from precompile.runtime.compiler_interface import MemoryPayloads

SWEEP = [1, 2, 3, 7, 16, 100, 256, 1000]


def sweep_inputs(mlp: Compiled) -> tuple[list[list[object]], list[torch.Tensor]]:
    torch.manual_seed(3)
    args, expected = [], []
    for n in SWEEP:
        x = torch.randn(n, 32)
        flat = [a.detach() if isinstance(a, torch.Tensor) else a for a in mlp.captured.flat(x)]
        args.append(flat)
        with torch.no_grad():
            expected.append(mlp.captured.model(x))
    return args, expected


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_round_trip_in_process(mlp: Compiled, saved: dict[str, str], fmt: str) -> None:
    loaded = precompile.CompiledArtifact.load(path=saved[fmt], format=fmt)  # type: ignore[arg-type]
    assert loaded.variants == mlp.artifact.variants
    assert loaded.symbols == mlp.artifact.symbols
    args, expected = sweep_inputs(mlp)
    for flat, want in zip(args, expected, strict=True):
        assert_close(loaded(*flat), want)


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_fresh_process_loads_and_never_lowers_a_graph(
    mlp: Compiled, saved: dict[str, str], fmt: str, tmp_path: object
) -> None:
    args, expected = sweep_inputs(mlp)
    cases = os.path.join(str(tmp_path), "cases.pt")
    torch.save({"args": args, "expected": expected}, cases)
    out = run_python(
        f"""
        import torch, torch._inductor.graph as graph
        def refuse(*a, **k):
            raise AssertionError("an inductor graph compile ran during load or call")
        graph.GraphLowering.__init__ = refuse
        import precompile
        from torch._dynamo.utils import counters
        art = precompile.CompiledArtifact.load(path={saved[fmt]!r}, format={fmt!r})
        cases = torch.load({cases!r})
        for flat, want in zip(cases["args"], cases["expected"]):
            torch.testing.assert_close(art(*flat)[0], want, rtol=1e-4, atol=1e-4)
        print("variants", sorted({{art.variant_for(*f) for f in cases["args"]}}))
        print("lowerings", counters["inductor"].get("fxgraph_cache_miss", 0))
        print("ok", len(cases["args"]))
        """
    )
    assert f"ok {len(SWEEP)}" in out
    assert "lowerings 0" in out


def test_binary_layout_is_ours(saved: dict[str, str]) -> None:
    with open(saved["binary"], "rb") as handle:
        head = handle.read(12)
    assert head == b"\x93PRECOMPILE\n"


def test_unpacked_has_readable_manifest_and_code(mlp: Compiled, saved: dict[str, str]) -> None:
    import json

    with open(os.path.join(saved["unpacked"], "manifest.json")) as handle:
        manifest = json.load(handle)
    assert manifest["environment"]["torch"] == torch.__version__
    assert [v["point"] for v in manifest["variants"]] == [
        dict(v.point) for v in mlp.artifact.variants
    ]
    for digest in mlp.artifact.manifest.graph_digests:
        code = os.path.join(saved["unpacked"], "variants", digest, "output_code.py")
        with open(code) as handle:
            assert "def call(" in handle.read()
    kernels = mlp.artifact.manifest.kernel_digests
    assert kernels, "a CPU artifact ships its built C++ kernels"
    for digest in kernels:
        with open(os.path.join(saved["unpacked"], "kernels", f"{digest}.so"), "rb") as handle:
            assert handle.read(4) == b"\x7fELF"


def test_editing_unpacked_code_takes_effect_only_when_asked(
    mlp: Compiled, saved: dict[str, str], tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    edited_dir = os.path.join(str(tmp_path), "edited")
    shutil.copytree(saved["unpacked"], edited_dir)
    x = torch.randn(100, 32)
    flat = mlp.captured.flat(x)
    variant = mlp.artifact.variants[mlp.artifact.variant_for(*flat)]
    code_path = os.path.join(edited_dir, "variants", variant.payload, "output_code.py")
    with open(code_path) as handle:
        code = handle.read()
    call_body = code[code.index("def call(") :]
    match = re.search(r"return \((\w+), \)", call_body)
    assert match, "generated code has no single-output return"
    name = match.group(1)
    patched = call_body.replace(match.group(0), f"return ({name}.mul_(2), )", 1)
    with open(code_path, "w") as handle:
        handle.write(code[: code.index("def call(")] + patched)
    # An edit runs only when the load opts in; otherwise it is ignored, with a warning.
    with caplog.at_level(logging.WARNING, logger="precompile"):
        ignored = precompile.CompiledArtifact.load(path=edited_dir, format="unpacked")
        with torch.no_grad():
            assert_close(ignored(*flat), mlp.captured.model(x))
    assert "is ignored; load with run_edited_code=True" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="precompile"):
        loaded = precompile.CompiledArtifact.load(
            path=edited_dir, format="unpacked", run_edited_code=True
        )
        with torch.no_grad():
            assert_close(loaded(*flat), 2 * mlp.captured.model(x))
    assert "running edited generated code" in caplog.text
    with torch.no_grad():
        # variants whose code was not edited are unchanged
        small = torch.randn(1, 32)
        assert_close(loaded(*mlp.captured.flat(small)), mlp.captured.model(small))


def _damaged_copies(path: str) -> dict[str, bytes]:
    with open(path, "rb") as handle:
        data = handle.read()
    flipped_tail = bytearray(data)
    flipped_tail[-5] ^= 0x40
    from precompile.runtime._binary_format import HEADER_SIZE

    flipped_index = bytearray(data)
    flipped_index[HEADER_SIZE + 20] ^= 0x01
    return {
        "payload byte flipped": bytes(flipped_tail),
        "index byte flipped": bytes(flipped_index),
        "truncated in payloads": data[:-100],
        "truncated in header": data[:30],
        "empty": b"",
        "random bytes": os.urandom(4096),
        "upstream artifact": b"\x15\x00\x00\x00CacheCompiledArtifact" + os.urandom(200),
        "trailing garbage": data + b"extra",
    }


def test_damaged_binary_files_are_corrupt_artifact_errors(
    saved: dict[str, str], tmp_path: object
) -> None:
    for label, content in _damaged_copies(saved["binary"]).items():
        path = os.path.join(str(tmp_path), "damaged.pt2c")
        with open(path, "wb") as handle:
            handle.write(content)
        with pytest.raises(precompile.CorruptArtifactError) as info:
            precompile.CompiledArtifact.load(path=path)
        assert isinstance(info.value, ValueError), label


def test_damaged_unpacked_dirs_are_corrupt_artifact_errors(
    saved: dict[str, str], tmp_path: object
) -> None:
    import shutil

    def fresh(name: str) -> str:
        target = os.path.join(str(tmp_path), name)
        shutil.copytree(saved["unpacked"], target)
        return target

    flipped = fresh("flipped")
    digest = os.listdir(os.path.join(flipped, "variants"))[0]
    payload = os.path.join(flipped, "variants", digest, "payload.bin")
    with open(payload, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(precompile.CorruptArtifactError, match="sha256"):
        precompile.CompiledArtifact.load(path=flipped, format="unpacked")

    hostile = fresh("hostile")
    manifest = os.path.join(hostile, "manifest.json")
    with open(manifest) as handle:
        text = handle.read()
    with open(manifest, "w") as handle:
        handle.write(
            text.replace('"guards": [', '"guards": ["__import__(\'os\').getpid() > 0", ', 1)
        )
    with pytest.raises(precompile.CorruptArtifactError):
        precompile.CompiledArtifact.load(path=hostile, format="unpacked")

    missing = fresh("missing")
    os.unlink(os.path.join(missing, "manifest.json"))
    with pytest.raises(precompile.CorruptArtifactError, match=r"manifest\.json"):
        precompile.CompiledArtifact.load(path=missing, format="unpacked")


def test_artifact_from_another_torch_build_is_refused(mlp: Compiled, tmp_path: object) -> None:
    art = mlp.artifact
    other = dataclasses.replace(art.manifest.environment, torch="2.99.0", torch_git="0" * 40)
    manifest = dataclasses.replace(art.manifest, environment=other)
    path = os.path.join(str(tmp_path), "old.pt2c")
    write_binary(path, manifest, art._payloads)
    with pytest.raises(
        precompile.IncompatibleArtifactError,
        match=r"torch 2\.99\.0.*" + re.escape(torch.__version__),
    ):
        precompile.CompiledArtifact.load(path=path)


def test_wrong_format_and_paths_are_clear(
    saved: dict[str, str], mlp: Compiled, tmp_path: object
) -> None:
    with pytest.raises(precompile.InvalidOptionError, match="format must be"):
        mlp.artifact.save(path=os.path.join(str(tmp_path), "x"), format="zip")  # type: ignore[arg-type]
    with pytest.raises(precompile.InvalidOptionError, match="is a directory"):
        mlp.artifact.save(path=str(tmp_path), format="binary")
    with pytest.raises(precompile.InvalidOptionError, match="format='unpacked'"):
        precompile.CompiledArtifact.load(path=saved["unpacked"], format="binary")
    with pytest.raises(precompile.InvalidOptionError, match="format='binary'"):
        precompile.CompiledArtifact.load(path=saved["binary"], format="unpacked")
    # ours, and still a FileNotFoundError (a client trial: a plain one escaped
    # `except PrecompileError`)
    with pytest.raises(precompile.ArtifactNotFoundError, match=r"no artifact at .*absent"):
        precompile.CompiledArtifact.load(path=os.path.join(str(tmp_path), "absent.pt2c"))


class _FailingPayloads(MemoryPayloads):
    def read(self, digest: str) -> bytes:
        raise OSError("disk went away")


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_failed_save_keeps_previous_artifact(
    mlp: Compiled, saved: dict[str, str], fmt: str, tmp_path: object
) -> None:
    import shutil

    target = os.path.join(str(tmp_path), "target")
    if fmt == "binary":
        shutil.copy(saved["binary"], target)
    else:
        shutil.copytree(saved["unpacked"], target)
    broken = precompile.CompiledArtifact(mlp.artifact.manifest, _FailingPayloads({}))
    with pytest.raises(OSError, match="disk went away"):
        broken.save(path=target, format=fmt)  # type: ignore[arg-type]
    assert sorted(os.listdir(str(tmp_path))) == ["target"]  # no temp files left behind
    reloaded = precompile.CompiledArtifact.load(path=target, format=fmt)  # type: ignore[arg-type]
    assert reloaded.variants == mlp.artifact.variants


def test_a_moved_manifest_is_format_6_and_runs_its_lean_variants_only(
    mlp: Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``to()`` writes: ``moved_from`` in a version-6 document (a version-5 reader
    refuses it); a version-5 document naming it, or a version-6 one without it, is
    corrupt; with the lean path off a moved artifact is refused, never run through the
    inductor code compiled for its first device."""
    manifest = mlp.artifact.manifest
    assert all(v.lean is not None for v in manifest.variants)
    moved = dataclasses.replace(manifest, moved_from=0)
    document = moved.to_json()
    assert document["format_version"] == 6 and document["moved_from"] == 0
    assert precompile.Manifest.from_json(document) == moved
    assert "moved_from" not in manifest.to_json() and manifest.to_json()["format_version"] == 5
    with pytest.raises(precompile.CorruptArtifactError, match="moved_from"):
        precompile.Manifest.from_json({**document, "format_version": 5})
    with pytest.raises(precompile.CorruptArtifactError, match="moved_from"):
        precompile.Manifest.from_json({**document, "moved_from": None})
    payloads = MemoryPayloads({d: mlp.artifact.payload_bytes(d) for d in manifest.payload_digests})
    x = torch.randn(4, 32)
    with torch.no_grad():
        served = precompile.CompiledArtifact(moved, payloads)
        assert_close(served(*mlp.captured.flat(x))[0], mlp.captured.model(x))
        monkeypatch.setenv("PRECOMPILE_LEAN", "0")
        with pytest.raises(precompile.IncompatibleArtifactError, match="lean variants only"):
            precompile.CompiledArtifact(moved, payloads)


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_save_never_replaces_what_is_not_an_artifact_and_names_failures(
    mlp: Compiled, tmp_path: Any, fmt: str
) -> None:
    """``save`` renames its output into place: over a FIFO or a device it replaced the
    node by a regular file (a docs-only client trial, running as root, turned
    ``/dev/null`` into an artifact). Such a path is refused, as an empty path is; an
    OS failure to write is the library's ``CacheWriteError`` naming the path."""
    import stat as stat_module

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(precompile.InvalidOptionError, match="fifo"):
        mlp.artifact.save(path=fifo, format=fmt)  # type: ignore[arg-type]
    assert stat_module.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(precompile.InvalidOptionError, match="empty"):
        mlp.artifact.save(path="", format=fmt)  # type: ignore[arg-type]
    if os.path.isdir("/proc/self"):  # a directory no file can be made in
        with pytest.raises(precompile.CacheWriteError, match="could not save the artifact"):
            mlp.artifact.save(path="/proc/self/no-artifact", format=fmt)  # type: ignore[arg-type]
    assert [p for p in os.listdir(tmp_path) if p.startswith(".precompile-")] == []


def test_a_save_removes_what_saves_killed_part_way_left(mlp: Compiled, tmp_path: Any) -> None:
    """A save killed part way leaves its temp file (binary) or staging dir (unpacked)
    beside its target, the target untouched (a client trial: 25 kills, 25 left). The
    next save there removes those whose writer is gone (each writer locks its own while
    it writes); one a live writer holds, one younger than a minute and the previous
    version of an unpacked artifact (``.precompile-old-*``) stay."""
    import fcntl
    import time as time_module

    def made(name: str, directory: bool, age: float) -> str:
        path = str(tmp_path / name)
        if directory:
            os.mkdir(path)
            with open(os.path.join(path, "payload.bin"), "wb") as handle:
                handle.write(b"x")
        else:
            with open(path, "wb") as handle:
                handle.write(b"partial")
        then = time_module.time() - age
        os.utime(path, (then, then))
        return path

    abandoned = [made(".precompile-aaaaaaaa.tmp", False, 120),
                 made(".precompile-bbbbbbbb", True, 120)]  # fmt: skip
    held = made(".precompile-cccccccc.tmp", False, 120)
    young = made(".precompile-dddddddd.tmp", False, 0)
    previous = made(".precompile-old-eeeeeeee", True, 120)
    other = made("notes.tmp", False, 120)
    writer = os.open(held, os.O_RDONLY)
    fcntl.flock(writer, fcntl.LOCK_EX)  # a save in progress, in another "process"
    try:
        mlp.artifact.save(path=str(tmp_path / "mlp.pt2c"))
    finally:
        os.close(writer)
    assert not any(os.path.exists(p) for p in abandoned)
    assert all(os.path.exists(p) for p in (held, young, previous, other))
    mlp.artifact.save(path=str(tmp_path / "mlp_dir"), format="unpacked")  # type: ignore[arg-type]
    assert not os.path.exists(held)  # its writer let go
    loaded = precompile.CompiledArtifact.load(path=str(tmp_path / "mlp.pt2c"))
    assert loaded.variants == mlp.artifact.variants
