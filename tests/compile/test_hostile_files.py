"""Artifacts written by an attacker who recomputes every digest, or damaged by accident:
each load ends in a clear error of ours (never RecursionError, TypeError, MemoryError, a
hang, or code that was not checked), and with bounded memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zstandard
from conftest import ROOT, Compiled, assert_close, run_python

import precompile
from precompile.cache import sha256_hex
from precompile.runtime._binary_format import _FIELDS, HEADER_SIZE, pack_header


def _read(path: str) -> tuple[tuple[Any, ...], dict[str, Any], bytes]:
    with open(path, "rb") as handle:
        data = handle.read()
    header = _FIELDS.unpack_from(data)
    index_length = header[2]
    index = json.loads(data[HEADER_SIZE : HEADER_SIZE + index_length])
    return header, index, data[HEADER_SIZE + index_length :]


def _write(path: str, header: tuple[Any, ...], index_bytes: bytes, payloads: bytes) -> None:
    """An artifact whose index digest (and header digest) is recomputed: only our
    validation stands between its contents and the code that runs."""
    _, _, _, _, public, signature = header
    digest = bytes.fromhex(sha256_hex(index_bytes))
    packed = pack_header(len(index_bytes), digest, public, signature)
    with open(path, "wb") as handle:
        handle.write(packed + index_bytes + payloads)


def _hostile(source: str, target: str, mutate: Callable[[dict[str, Any]], Any]) -> str:
    header, index, payloads = _read(source)
    replaced = mutate(index)
    raw = replaced if isinstance(replaced, bytes) else json.dumps(index).encode()
    _write(target, header, raw, payloads)
    return target


def _rename_symbol(manifest: dict[str, Any], old: str, new: str) -> None:
    """Rename a symbol everywhere a manifest names it (as an attacker could)."""
    import re

    pattern = re.compile(rf"\b{old}\b")
    document = json.loads(json.dumps(manifest).replace(f'"{old}"', f'"{new}"'))
    for variant in document["variants"]:
        variant["guards"] = [pattern.sub(new, g) for g in variant["guards"]]
    for spec in document["inputs"]:
        if spec["kind"] == "tensor":
            for field in ("shape", "stride"):
                spec[field] = [
                    pattern.sub(new, s) if isinstance(s, str) else s for s in spec[field]
                ]
    manifest.clear()
    manifest.update(document)


@pytest.mark.parametrize(
    ("case", "mutate", "message"),
    [
        ("100k-deep JSON", lambda i: b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (
            "torch_git an int",
            lambda i: i["manifest"]["environment"].__setitem__("torch_git", 5),
            "environment.torch_git should be str",
        ),
        (
            "5000-digit int",
            lambda i: json.dumps(i).replace('"max": null', '"max": ' + "9" * 5000, 1).encode(),
            "not valid JSON",
        ),
        (
            "a symbol named max",
            lambda i: _rename_symbol(i["manifest"], i["manifest"]["symbols"][0]["name"], "max"),
            "name of a function",
        ),
        (
            "a guard with a comment",
            lambda i: i["manifest"]["variants"][0]["guards"].append("s0 >= 0 #"),
            "'#'",
        ),
        (
            "guards that swallow each other",
            lambda i: i["manifest"]["variants"][0]["guards"].extend(
                ["s0 >= 0 #", "min((s0 <= 8 #\n), 1) #"]
            ),
            "'#'",
        ),
        (
            "a tower of powers",
            lambda i: i["manifest"]["variants"][0]["guards"].append("((9**64)**64)**64 > 0"),
            "power",
        ),
        (
            "deep nesting under the length cap",
            lambda i: i["manifest"]["variants"][0]["guards"].append("(" * 3000 + "1" + ")" * 3000),
            "",
        ),
        (
            "a calibration key not ASCII",
            lambda i: i["manifest"].__setitem__(
                "calibration",
                {
                    "device_name": "x",
                    "method": "m",
                    "min_gain": 0.0,
                    "entries": [{"point": [1], "times": {"²": 1.0}}],
                },
            ),
            "names no variant",
        ),
        (
            "a negative payload size",
            lambda i: next(iter(i["payloads"].values())).__setitem__("raw_size", -1),
            "absurd",
        ),
    ],
)
def test_hostile_but_digest_consistent_indexes_are_corrupt(
    saved: dict[str, str], tmp_path: Any, case: str, mutate: Any, message: str
) -> None:
    target = os.path.join(str(tmp_path), "hostile.pt2c")
    _hostile(saved["binary"], target, mutate)
    with pytest.raises(precompile.CorruptArtifactError, match=message):
        precompile.CompiledArtifact.load(path=target)


@pytest.mark.parametrize("name", ["len", "a2", "args", "sh", "GUARD", "v_s0", "T"])
def test_symbols_named_like_generated_locals_work(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any, name: str
) -> None:
    """The generated checks spell symbols v_<name>: a symbol called ``len`` or ``a2``
    (the names of a builtin and of a generated local) shadows nothing."""
    target = os.path.join(str(tmp_path), f"{name}.pt2c")
    old = mlp.artifact.symbols[0].name

    def rename(index: dict[str, Any]) -> None:
        _rename_symbol(index["manifest"], old, name)

    _hostile(saved["binary"], target, rename)
    art = precompile.CompiledArtifact.load(path=target)
    assert art.symbols[0].name == name
    x = torch.randn(37, 32)
    with torch.no_grad():
        assert_close(art(*mlp.captured.flat(x)), mlp.captured.model(x))
    assert art.sizes_of(*mlp.captured.flat(x)) == {name: 37}


def _bomb(raw_size: int, declared: int | None) -> bytes:
    """A zstd frame of zeros declaring ``declared`` bytes (None: no declared size)."""
    compressor = zstandard.ZstdCompressor(write_content_size=declared is not None)
    if declared is None:
        return compressor.compress(bytes(raw_size))
    chunk = bytes(1 << 20)
    writer = compressor.compressobj(size=declared)
    out = [writer.compress(chunk) for _ in range(declared // len(chunk))]
    return b"".join([*out, writer.flush()])


def _with_payload(source: str, target: str, stored: bytes, raw_size: int) -> None:
    """Replace the bytes of the first payload a load reads (the first variant's lean
    source, or its graph where it has none) by ``stored`` claiming ``raw_size``, every
    digest in the index recomputed to match the new bytes."""
    header, index, payloads = _read(source)
    table = index["payloads"]
    variant = index["manifest"]["variants"][0]
    first = variant["lean"]["source"] if variant.get("lean") else variant["payload"]
    old = table[first]
    start, end = old["offset"], old["offset"] + old["size"]
    for entry in table.values():
        if entry["offset"] > start:
            entry["offset"] += len(stored) - old["size"]
    old.update(size=len(stored), raw_size=raw_size, stored_sha256=sha256_hex(stored))
    _write(target, header, json.dumps(index).encode(), payloads[:start] + stored + payloads[end:])


BOUNDED_LOAD = """
import resource, sys, time, torch, precompile
sys.path.insert(0, "tests")
started = time.perf_counter()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    art = precompile.CompiledArtifact.load(path=sys.argv[1])
    art.warmup()
    print("loaded")
except precompile.PrecompileError as exc:
    print("refused", type(exc).__name__, str(exc)[:200])
grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(f"grown_mb {grown_mb:.0f} seconds {time.perf_counter() - started:.1f}")
"""


@pytest.mark.parametrize(
    ("case", "stored", "raw_size", "env"),
    [
        ("frame declares 1 GiB, index agrees", lambda: _bomb(0, 1 << 30), 1 << 30, {}),
        ("frame declares 1 TiB", lambda: _bomb(0, 1 << 20), 1 << 40, {}),
        ("no declared size, index says 2**40", lambda: _bomb(1 << 20, None), 1 << 40, {}),
        (
            "over a lowered maximum",
            lambda: _bomb(0, 64 << 20),
            64 << 20,
            {"PRECOMPILE_MAX_PAYLOAD_BYTES": str(16 << 20)},
        ),
    ],
)
def test_decompression_is_bounded(
    saved: dict[str, str], tmp_path: Any, case: str, stored: Any, raw_size: int, env: Any
) -> None:
    target = os.path.join(str(tmp_path), "bomb.pt2c")
    _with_payload(saved["binary"], target, stored(), raw_size)
    result = subprocess.run(
        [sys.executable, "-c", BOUNDED_LOAD, target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # Over the maximum: refused as such (a healthy artifact may be that large); else damage.
    refused = (
        "PayloadLimitError"
        if raw_size > int(env.get("PRECOMPILE_MAX_PAYLOAD_BYTES", 8 << 30))
        else "CorruptArtifactError"
    )
    assert f"refused {refused}" in result.stdout, result.stdout
    grown = float(result.stdout.split("grown_mb")[1].split()[0])
    assert grown < 200, result.stdout  # streamed and checked in chunks, never held


def test_special_files_are_not_artifacts(tmp_path: Any) -> None:
    with pytest.raises(precompile.InvalidOptionError, match="not a regular file"):
        precompile.CompiledArtifact.load(path="/dev/zero")
    fifo = os.path.join(str(tmp_path), "fifo")
    os.mkfifo(fifo)
    with pytest.raises(precompile.InvalidOptionError, match="not a regular file"):
        precompile.CompiledArtifact.load(path=fifo)


def _copy(saved: dict[str, str], tmp_path: Any, name: str) -> str:
    target = os.path.join(str(tmp_path), name)
    shutil.copytree(saved["unpacked"], target)
    return target


def test_unpacked_files_may_not_be_links(saved: dict[str, str], tmp_path: Any) -> None:
    outside = os.path.join(str(tmp_path), "outside.py")
    with open(outside, "w") as handle:
        handle.write("import os\nos.environ['PRECOMPILE_PWNED'] = '1'\n")
    linked = _copy(saved, tmp_path, "code-link")
    digest = os.listdir(os.path.join(linked, "variants"))[0]
    code = os.path.join(linked, "variants", digest, "output_code.py")
    os.unlink(code)
    os.symlink(outside, code)
    for opt_in in (False, True):
        with pytest.raises(precompile.CorruptArtifactError, match="symbolic link"):
            precompile.CompiledArtifact.load(path=linked, format="unpacked", run_edited_code=opt_in)
    assert "PRECOMPILE_PWNED" not in os.environ

    zero = _copy(saved, tmp_path, "manifest-link")
    os.unlink(os.path.join(zero, "manifest.json"))
    os.symlink("/dev/zero", os.path.join(zero, "manifest.json"))
    with pytest.raises(precompile.CorruptArtifactError, match="symbolic link"):
        precompile.CompiledArtifact.load(path=zero, format="unpacked")

    variants = _copy(saved, tmp_path, "dir-link")
    shutil.move(os.path.join(variants, "variants"), os.path.join(str(tmp_path), "elsewhere"))
    os.symlink(os.path.join(str(tmp_path), "elsewhere"), os.path.join(variants, "variants"))
    with pytest.raises(precompile.CorruptArtifactError, match="symbolic link"):
        precompile.CompiledArtifact.load(path=variants, format="unpacked")


def test_hostile_unpacked_calibration_key(saved: dict[str, str], tmp_path: Any) -> None:
    target = _copy(saved, tmp_path, "calibration")
    path = os.path.join(target, "manifest.json")
    with open(path) as handle:
        document = json.load(handle)
    document["calibration"] = {
        "device_name": "x",
        "method": "m",
        "min_gain": 0.0,
        "entries": [{"point": [1], "times": {"²": 1.0}}],
    }
    with open(path, "w") as handle:
        json.dump(document, handle)
    with pytest.raises(precompile.CorruptArtifactError, match="names no variant"):
        precompile.CompiledArtifact.load(path=target, format="unpacked")


def test_an_edited_cpp_kernel_is_rebuilt_from_source(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel is looked up by the sha256 of its source: an unchanged kernel runs its
    bundled binary even in edited code, an edited one is built with a warning."""
    import logging
    import re

    target = _copy(saved, tmp_path, "edited-kernel")
    x = torch.randn(100, 32)
    flat = mlp.captured.flat(x)
    variant = mlp.artifact.variants[mlp.artifact.variant_for(*flat)]
    path = os.path.join(target, "variants", variant.payload, "output_code.py")
    with open(path) as handle:
        code = handle.read()
    assert "cpp_pybinding" in code
    # A harmless change to the first C++ kernel's source: a comment line.
    edited = re.sub(r"(cpp_pybinding\(\[[^\]]*\], r''')", r"\1\n// edited by hand", code, count=1)
    assert edited != code
    with open(path, "w") as handle:
        handle.write(edited)
    with caplog.at_level(logging.WARNING, logger="precompile"):
        art = precompile.CompiledArtifact.load(path=target, format="unpacked", run_edited_code=True)
        with torch.no_grad():
            assert_close(art(*flat), mlp.captured.model(x))
    assert "building C++ kernel" in caplog.text and "from source" in caplog.text


def test_an_artifact_the_user_cannot_enter_says_so(saved: dict[str, str], tmp_path: Any) -> None:
    target = _copy(saved, tmp_path, "locked")
    os.chmod(target, 0o000)
    os.chmod(str(tmp_path), 0o755)
    try:
        code = f"""
import os, precompile
# Import everything a load needs first: an interpreter installed under /root cannot be
# read by the user the test becomes.
precompile.CompiledArtifact.load(path={saved["unpacked"]!r}, format="unpacked")
if os.getuid() == 0:
    os.setgid(65534); os.setuid(65534)  # nobody: root ignores mode bits
try:
    precompile.CompiledArtifact.load(path={target!r}, format="unpacked")
except precompile.ArtifactAccessError as exc:
    print("refused", isinstance(exc, PermissionError), exc)
"""
        out = run_python(textwrap.dedent(code), env={"PRECOMPILE_CACHE_DIR": "/tmp"})
    finally:
        os.chmod(target, 0o755)
    assert "refused True" in out and "may not open it" in out, out


def test_bad_sizes_in_the_payload_table_are_corrupt(saved: dict[str, str], tmp_path: Any) -> None:
    target = _copy(saved, tmp_path, "sizes")
    path = os.path.join(target, "manifest.json")
    with open(path) as handle:
        document = json.load(handle)
    first = next(iter(document["payload_files"]))
    document["payload_files"][first]["size"] = 2**62
    with open(path, "w") as handle:
        json.dump(document, handle)
    with pytest.raises(precompile.PayloadLimitError, match=r"over the \d+-byte maximum"):
        precompile.CompiledArtifact.load(path=target, format="unpacked")


HOSTILE_VALUES = """
import sys, torch, precompile
sys.path.insert(0, "tests")
from conftest import MLP
torch.manual_seed(0)
model = MLP(width=32, hidden=64).eval()
model.load_state_dict(torch.load({state!r}))
art = precompile.CompiledArtifact.load(path={path!r})
cases = torch.load({cases!r})


def outcome(x, args):
    try:
        with torch.no_grad():
            ours = art(*args)[0]
    except Exception as exc:  # the process lives on: what was raised
        return type(exc).__name__
    with torch.no_grad():
        eager = model(x)
    same = ours.shape == eager.shape and torch.allclose(ours, eager, atol=1e-5, equal_nan=True)
    return "served, equal to eager" if same else "served, DIFFERENT from eager"


for name, (x, args) in cases.items():
    print(name, "->", outcome(x, args), flush=True)
"""


def test_hostile_values_never_end_a_process(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any
) -> None:
    """A saved artifact loaded in a fresh process, fed NaN, inf, huge values, an empty
    batch, a large batch, a wrong width and a wrong dtype: each call is served as eager
    serves it (NaN where eager has NaN) or refused with an exception, and the process
    lives to its last case."""
    inputs = {
        "nan": torch.full((4, 32), float("nan")),
        "inf": torch.full((4, 32), float("inf")),
        "-inf and huge": torch.tensor([[-float("inf"), 3e38] * 16] * 3),
        "empty batch": torch.zeros(0, 32),
        "large batch": torch.randn(20000, 32),
        "wrong width": torch.randn(4, 33),
        "int": torch.ones(4, 32, dtype=torch.long),
    }
    good = mlp.captured.flat(torch.randn(4, 32))
    (position,) = [i for i, user in mlp.captured.user_positions.items() if user == 0]
    cases = {}
    for name, x in inputs.items():
        try:
            args = mlp.captured.flat(x)
        except AssertionError:  # no dim carries a size of x's: the good call's, x in place
            args = [x if i == position else a for i, a in enumerate(good)]
        cases[name] = (x, args)
    state, path = str(tmp_path / "state.pt"), str(tmp_path / "cases.pt")
    torch.save(mlp.captured.model.state_dict(), state)
    torch.save(cases, path)
    out = run_python(HOSTILE_VALUES.format(state=state, path=saved["binary"], cases=path))
    lines = dict(line.split(" -> ", 1) for line in out.splitlines() if " -> " in line)
    assert len(lines) == 7, out
    for name in ("nan", "inf", "-inf and huge", "large batch"):
        assert lines[name] == "served, equal to eager", out
    assert lines["wrong width"] == "InputMismatchError" and lines["int"] == "InputMismatchError"
    assert lines["empty batch"] in ("served, equal to eager", "NoVariantError"), out
    assert "DIFFERENT" not in out, out


def _cli_verify(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "precompile", "verify", path],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip


def test_every_header_byte_is_covered_by_a_check(saved: dict[str, str], tmp_path: Any) -> None:
    """A flipped byte anywhere in an unsigned file's header (its fields, the zeros of its
    signature slot, its own digest) is refused, never read as a signature or served: a
    version-2 header had no digest, and byte 100 flipped read as "signed by key
    66687aadf862bd77" (the sha256 of 32 zero bytes)."""
    with open(saved["binary"], "rb") as handle:
        data = handle.read()
    target = os.path.join(str(tmp_path), "flipped.pt2c")
    for offset in range(HEADER_SIZE):
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        with open(target, "wb") as handle:
            handle.write(flipped)
        with pytest.raises((precompile.CorruptArtifactError, precompile.IncompatibleArtifactError)):
            precompile.CompiledArtifact.load(path=target)
    result = _cli_verify(target)  # the last one: the header's own digest
    assert result.returncode == 1 and "header fails its sha256 check" in result.stderr
    flipped = bytearray(data)
    flipped[100] ^= 0x01  # the case found: a byte of the unsigned file's signature slot
    with open(target, "wb") as handle:
        handle.write(flipped)
    result = _cli_verify(target)
    assert result.returncode == 1 and "signed by key" not in result.stdout, result


def test_a_version_2_file_still_loads_and_its_empty_slot_is_checked(
    saved: dict[str, str], tmp_path: Any
) -> None:
    """Files written before the header digest (version 2) load as before; their slot,
    which no digest covers, must be all zeros where no key is named."""
    with open(saved["binary"], "rb") as handle:
        data = handle.read()
    fields = list(_FIELDS.unpack_from(data))
    fields[1] = 2
    old = bytearray(_FIELDS.pack(*fields) + data[HEADER_SIZE:])
    target = os.path.join(str(tmp_path), "v2.pt2c")
    with open(target, "wb") as handle:
        handle.write(old)
    loaded = precompile.CompiledArtifact.load(path=target)
    assert len(loaded.variants) > 0
    old[100] ^= 0x01
    with open(target, "wb") as handle:
        handle.write(old)
    with pytest.raises(precompile.CorruptArtifactError, match="signature slot is not empty"):
        precompile.CompiledArtifact.load(path=target)


def test_guards_widened_by_hand_are_refused_by_the_code_by_name(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any
) -> None:
    """A manifest is checked for what can be checked without its code; a guard widened
    to admit every size (``s >= 0``) is a well-formed expression (a client trial). The
    code of the variant it lets in checks its inputs' sizes, and that refusal is a
    ``CorruptArtifactError`` saying so (it was inductor's bare ``AssertionError``);
    every call answers as eager or is refused."""
    target = _copy(saved, tmp_path, "widened")
    path = os.path.join(target, "manifest.json")
    with open(path) as handle:
        document = json.load(handle)
    for variant in document["variants"]:
        if variant["guards"]:
            name = next(s["name"] for s in document["symbols"])
            variant["guards"] = [f"{name} >= 0"]
    with open(path, "w") as handle:
        json.dump(document, handle)
    loaded = precompile.CompiledArtifact.load(path=target, format="unpacked")
    refused = 0
    with torch.no_grad():
        for batch in (1, 2, 3, 5, 16, 40):
            x = torch.randn(batch, 32)
            try:
                out = loaded(*mlp.captured.flat(x))
            except precompile.CorruptArtifactError as exc:
                assert "refused this call's inputs" in str(exc)
                refused += 1
                continue
            assert_close(out, mlp.captured.model(x))
    assert refused > 0
