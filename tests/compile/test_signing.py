"""Signed artifacts: with trusted keys configured, only artifacts signed by one of them
load, and the check comes before any byte of them is decoded, unpickled or imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from cache_helpers import fake_artifact, get, key_of, put
from conftest import ROOT, Compiled, assert_close

import precompile
from precompile.cache import ArtifactCache
from precompile.runtime._binary_format import _FIELDS, HEADER_SIZE, pack_header

pytest.importorskip("cryptography")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "precompile", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("keys")
    paths = {}
    for name in ("ours", "theirs"):
        path = str(directory / f"{name}.pem")
        made = _cli("keygen", path)
        assert made.returncode == 0, made.stderr
        paths[name] = path
        paths[name + ".hex"] = made.stdout.strip().split()[-1]
    assert oct(os.stat(paths["ours"]).st_mode & 0o777) == "0o600"
    return paths


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_a_signed_artifact_loads_only_under_its_key(
    mlp: Compiled, keys: dict[str, str], tmp_path: Any, fmt: str
) -> None:
    path = os.path.join(str(tmp_path), f"signed-{fmt}")
    mlp.artifact.save(path=path, format=fmt, signing_key=keys["ours"])  # type: ignore[arg-type]
    x = torch.randn(21, 32)
    for trusted in (keys["ours"] + ".pub", keys["ours.hex"], [keys["theirs.hex"], keys["ours"]]):
        art = precompile.CompiledArtifact.load(path=path, format=fmt, trusted_keys=trusted)  # type: ignore[arg-type]
        with torch.no_grad():
            assert_close(art(*mlp.captured.flat(x)), mlp.captured.model(x))
    with pytest.raises(precompile.UntrustedArtifactError, match="not among the trusted") as info:
        precompile.CompiledArtifact.load(path=path, format=fmt, trusted_keys=keys["theirs.hex"])  # type: ignore[arg-type]
    assert isinstance(info.value, PermissionError)
    # without keys configured, signatures are not required (and the artifact loads)
    assert precompile.CompiledArtifact.load(path=path, format=fmt).variants  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_unsigned_or_tampered_artifacts_are_refused_before_decoding(
    saved: dict[str, str],
    keys: dict[str, str],
    tmp_path: Any,
    fmt: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from precompile.runtime import _manifest

    signed = os.path.join(str(tmp_path), f"signed-{fmt}")
    if fmt == "binary":
        shutil.copy(saved["binary"], signed)
    else:
        shutil.copytree(saved["unpacked"], signed)
    assert _cli("sign", "--key", keys["ours"], signed).returncode == 0
    monkeypatch.setenv("PRECOMPILE_TRUSTED_KEYS", keys["ours.hex"])

    def decoded(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the manifest was decoded before the signature was checked")

    monkeypatch.setattr(_manifest.Manifest, "from_json", staticmethod(decoded))
    with pytest.raises(precompile.UntrustedArtifactError, match="not signed"):
        precompile.CompiledArtifact.load(path=saved[fmt], format=fmt)  # type: ignore[arg-type]
    if fmt == "binary":
        with open(signed, "rb") as handle:
            data = bytearray(handle.read())
        # a byte of the signature, the header's digest recomputed (as a forger would)
        header = list(_FIELDS.unpack_from(data))
        header[5] = bytes([header[5][0] ^ 0x01]) + header[5][1:]
        tampered_signature = pack_header(*header[2:]) + bytes(data[HEADER_SIZE:])
        index_start = HEADER_SIZE
        data[index_start + 30] ^= 0x01  # a byte of the index, its digests recomputed
        import hashlib

        header = list(_FIELDS.unpack_from(data))
        header[3] = hashlib.sha256(data[index_start : index_start + header[2]]).digest()
        data[:HEADER_SIZE] = pack_header(*header[2:])
        for label, content in (("signature", tampered_signature), ("index", bytes(data))):
            target = os.path.join(str(tmp_path), f"tampered-{label}")
            with open(target, "wb") as handle:
                handle.write(content)
            with pytest.raises(precompile.UntrustedArtifactError, match="does not match"):
                precompile.CompiledArtifact.load(path=target)
    else:
        manifest = os.path.join(signed, "manifest.json")
        with open(manifest) as handle:
            document = json.load(handle)
        document["variants"][0]["guards"].append("s77 >= 0")
        with open(manifest, "w") as handle:
            json.dump(document, handle)
        with pytest.raises(precompile.UntrustedArtifactError, match="does not match"):
            precompile.CompiledArtifact.load(path=signed, format="unpacked")
        with pytest.raises(precompile.UntrustedArtifactError, match="run_edited_code"):
            precompile.CompiledArtifact.load(path=signed, format="unpacked", run_edited_code=True)


def test_cli_verify_and_sign(saved: dict[str, str], keys: dict[str, str], tmp_path: Any) -> None:
    target = os.path.join(str(tmp_path), "a.pt2c")
    shutil.copy(saved["binary"], target)
    unsigned = _cli("verify", "--key", keys["ours"] + ".pub", target)
    assert unsigned.returncode == 1 and "not signed" in unsigned.stderr
    assert "Traceback" not in unsigned.stderr
    assert _cli("sign", "--key", keys["ours"], target).returncode == 0
    ok = _cli("verify", "--key", keys["ours"] + ".pub", target)
    assert ok.returncode == 0 and "intact" in ok.stdout and "signed by key" in ok.stdout
    other = _cli("verify", "--key", keys["theirs"] + ".pub", target)
    assert other.returncode == 1 and "not among the trusted keys" in other.stderr
    plain = _cli("verify", target)
    assert plain.returncode == 0 and "no trusted keys given" in plain.stdout
    assert "the signature matches the key it names" in plain.stdout
    # A forged slot whose header digest was recomputed: without trusted keys too, a
    # signature that does not match its own key is a corrupt file, never "signed by".
    with open(target, "rb") as handle:
        data = handle.read()
    header = list(_FIELDS.unpack_from(data))
    header[5] = bytes([header[5][0] ^ 0x01]) + header[5][1:]
    with open(target, "wb") as handle:
        handle.write(pack_header(*header[2:]) + data[HEADER_SIZE:])
    forged = _cli("verify", target)
    assert forged.returncode == 1 and "does not match its contents" in forged.stderr
    with pytest.raises(precompile.CorruptArtifactError, match="does not match its contents"):
        precompile.CompiledArtifact.load(path=target)


def test_cache_entries_are_signed_and_checked(keys: dict[str, str], tmp_path: Any) -> None:
    root = str(tmp_path)
    writer = ArtifactCache(root, signing_key=keys["ours"])
    put(writer, key_of(1), fake_artifact(1), {"graph": "g"})
    put(ArtifactCache(root), key_of(2), fake_artifact(2), {"graph": "h"})  # unsigned
    reader = ArtifactCache(root, trusted_keys=[keys["ours"] + ".pub"])
    assert get(reader, key_of(1)) is not None
    with pytest.raises(precompile.UntrustedArtifactError, match="not signed"):
        get(reader, key_of(2))
    stranger = ArtifactCache(root, trusted_keys=keys["theirs.hex"])
    with pytest.raises(precompile.UntrustedArtifactError, match="not among"):
        get(stranger, key_of(1))
    entry = reader.entry_path(key_of(1))
    with open(entry) as handle:
        document = json.load(handle)
    document["factors"]["graph"] = "changed"  # the signature covers the whole document
    with open(entry, "w") as handle:
        json.dump(document, handle)
    with pytest.raises(precompile.UntrustedArtifactError, match="does not match"):
        get(reader, key_of(1))
    signed = _cli("cache", "--root", root, "sign", "--key", keys["ours"], key_of(2)[:10])
    assert signed.returncode == 0, signed.stderr
    assert get(reader, key_of(2)) is not None
    listing = _cli("cache", "--root", root, "ls")
    assert "signed" in listing.stdout


def test_cache_commands_that_read_change_no_last_use_and_no_count(
    keys: dict[str, str], tmp_path: Any
) -> None:
    """``ls``, ``info``, ``explain``, ``verify``, ``stats`` and ``tags`` leave every
    entry's last use (the LRU order prune evicts by) and the hit and miss counts as they
    were; ``sign`` writes the signature and keeps the last use."""
    from cache_helpers import fake_artifact, key_of, put

    root = str(tmp_path / "cache")
    store = ArtifactCache(root)
    for n in (1, 2):
        put(store, key_of(n), fake_artifact(n), {"graph": str(n), "device": "cpu"})
    store.tag("first", key_of(1))
    old = time.time() - 3600
    for n, when in ((1, old), (2, old + 60)):
        os.utime(store.entry_path(key_of(n)), (when, when))
    before = {n: os.stat(store.entry_path(key_of(n))).st_mtime_ns for n in (1, 2)}
    counts = store.stats()
    for args in (["ls"], ["info", key_of(1)[:10]], ["explain", key_of(1)[:10]], ["verify"],
                 ["stats"], ["tags"], ["sign", "--key", keys["ours"]]):  # fmt: skip
        done = _cli("cache", "--root", root, *args)
        assert done.returncode == 0, (args, done.stderr)
        after = {n: os.stat(store.entry_path(key_of(n))).st_mtime_ns for n in (1, 2)}
        assert after == before, args
        now = store.stats()
        assert (now.hits, now.misses) == (counts.hits, counts.misses), args
    assert all(e.signed for e in store.entries())
