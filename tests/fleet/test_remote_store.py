"""A remote tier on a store written in a few lines: ``RemoteStore`` is all the tier asks
of a store. An in-memory store shares a compile between two caches (and its leases hold
a key), the CLI takes a store by ``module:attr``, and an object that is not a store is
refused naming what it lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cache_helpers import fake_artifact, key_of, put
from conftest import ROOT, Compiled

import precompile
from precompile.cache import ArtifactCache, InvalidOptionError, RemoteStore


class MemoryStore:
    """A RemoteStore in one small class: objects in a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.created: list[str] = []
        self._lock = threading.Lock()

    def get(self, wanted: Sequence[tuple[str, int]]) -> list[bytes | None]:
        return [self.objects.get(name) for name, _ in wanted]

    def put(self, name: str, data: bytes) -> None:
        self.objects[name] = bytes(data)

    def create(self, name: str, data: bytes) -> bool | None:
        with self._lock:
            if name in self.objects:
                return False
            self.objects[name] = bytes(data)
            self.created.append(name)
            return True

    def exists(self, name: str) -> bool:
        return name in self.objects

    def delete(self, name: str) -> None:
        self.objects.pop(name, None)

    def names(self, folder: str) -> list[str]:
        prefix = folder + "/"
        return [n[len(prefix) :] for n in self.objects if n.startswith(prefix)]


def test_a_store_of_one_small_class_is_a_remote_tier(mlp: Compiled, tmp_path: Any) -> None:
    """One cache compiles (taking the key's lease in the store) and uploads; another,
    with its own local directory, is served from the store without compiling."""
    store = MemoryStore()
    assert isinstance(store, RemoteStore)
    captured = mlp.captured
    builder = ArtifactCache(str(tmp_path / "a"), remote=store)
    with torch.no_grad():
        built = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=builder
        )
    assert builder.stats().remote_uploads == 1
    assert [n.split("/")[0] for n in store.created] == ["leases"]  # single flight
    assert not any(n.startswith("leases/") for n in store.objects)  # released
    server = ArtifactCache(str(tmp_path / "b"), remote=store)
    with torch.no_grad():
        served = precompile.standalone_compile(  # compile=False: a miss would raise
            captured.gm, captured.example_inputs, hints=[16], cache=server, compile=False
        )
        x = torch.randn(7, 32)
        torch.testing.assert_close(served(*captured.flat(x))[0], built(*captured.flat(x))[0])
    assert server.stats().remote_hits == 1 and server.contains(served.cache_key)
    assert server.remote_entries() == [served.cache_key]


def test_a_lease_in_the_store_holds_the_key_for_another_machine(tmp_path: Any) -> None:
    store = MemoryStore()
    first = ArtifactCache(str(tmp_path / "a"), remote=store)
    second = ArtifactCache(str(tmp_path / "b"), remote=store, lock_timeout=0.5)
    with first.lock(key_of(1)):
        started = time.monotonic()
        with second.lock(key_of(1)):  # waits for the entry, then gives up and goes on
            waited = time.monotonic() - started
    assert waited >= 0.5 and store.objects == {}
    put(first, key_of(2), fake_artifact(2), {})  # an entry there: no lease is waited for
    started = time.monotonic()
    with second.lock(key_of(2)):
        assert time.monotonic() - started < 0.5


class HalfStore:
    def get(self, wanted: Any) -> list[bytes | None]:
        return []

    def put(self, name: str, data: bytes) -> None:
        pass

    exists = "not a method"


def test_an_object_that_is_not_a_store_is_refused_naming_what_it_lacks(tmp_path: Any) -> None:
    root = str(tmp_path / "a")
    with pytest.raises(
        InvalidOptionError, match=r"lacks the methods create, exists, delete, names"
    ):
        ArtifactCache(root, remote=HalfStore())  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match=r"object at .* lacks the methods get, put"):
        ArtifactCache(root, remote=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="remote_options are fsspec's"):
        ArtifactCache(root, remote=MemoryStore(), remote_options={"anon": True})
    # the class, not an object: its methods are there, unbound (found by a client trial:
    # accepted, then every remote call failed as a warning)
    with pytest.raises(InvalidOptionError, match=r"got the class .*MemoryStore.*make one"):
        ArtifactCache(root, remote=MemoryStore)  # type: ignore[arg-type]


class TextStore(MemoryStore):
    """Answers text where bytes are due."""

    def get(self, wanted: Sequence[tuple[str, int]]) -> list[Any]:
        return [None if d is None else d.decode("latin-1") for d in super().get(wanted)]


def test_a_store_answering_other_than_bytes_is_a_miss(tmp_path: Any) -> None:
    """A client trial: a store whose get returned str failed the compile with an
    AttributeError from the entry's decoding; it is a miss like any failing store."""
    store = TextStore()
    put(ArtifactCache(str(tmp_path / "a"), remote=store), key_of(1), fake_artifact(1), {})
    assert store.objects  # uploaded as bytes
    reader = ArtifactCache(str(tmp_path / "b"), remote=store)
    assert reader.get(key_of(1)) is None
    assert reader.stats().remote_errors >= 1


DIRECTORY_STORE = '''
import os


class DirectoryStore:
    """A RemoteStore on a plain directory, for the command line."""

    def __init__(self, path):
        self.path = path

    def _file(self, name):
        return os.path.join(self.path, *name.split("/"))

    def get(self, wanted):
        found = []
        for name, limit in wanted:
            try:
                with open(self._file(name), "rb") as handle:
                    found.append(handle.read(limit + 1))
            except FileNotFoundError:
                found.append(None)
        return found

    def put(self, name, data):
        path = self._file(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as handle:
            handle.write(data)
        os.replace(path + ".tmp", path)

    def create(self, name, data):
        return None  # no create-if-absent: no leases

    def exists(self, name):
        return os.path.exists(self._file(name))

    def delete(self, name):
        if os.path.exists(self._file(name)):
            os.remove(self._file(name))

    def names(self, folder):
        try:
            return os.listdir(self._file(folder))
        except FileNotFoundError:
            return []


NOT_A_STORE = object()
'''


def test_cli_takes_a_store_by_module_and_attribute(tmp_path: Any) -> None:
    (tmp_path / "directory_store.py").write_text(textwrap.dedent(DIRECTORY_STORE))
    options = json.dumps({"path": str(tmp_path / "shared")})
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    store = ArtifactCache(here)
    for n in (1, 2):
        put(store, key_of(n), fake_artifact(n), {})
    store.tag("model", key_of(2))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        }
        return subprocess.run(
            [sys.executable, "-m", "precompile", "cache", *args], cwd=tmp_path, env=env,
            capture_output=True, text=True,
        )  # fmt: skip

    spec = "directory_store:DirectoryStore"
    pushed = cli("--root", here, "push", spec, "--remote-options", options, "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert sorted(json.loads(pushed.stdout)["pushed"]) == sorted([key_of(1), key_of(2)])
    listing = cli("--root", there, "ls", "--remote", spec, "--remote-options", options, "--json")
    assert sorted(json.loads(listing.stdout)) == sorted([key_of(1), key_of(2)]), listing.stderr
    pulled = cli("--root", there, "pull", spec, "--tag", "model", "--remote-options", options)
    assert pulled.returncode == 0 and f"from {spec}" in pulled.stdout, pulled.stderr
    local = ArtifactCache(there)
    assert local.contains(key_of(2)) and not local.contains(key_of(1))
    assert local.tagged("model") == key_of(2)
    wrong = cli("--root", there, "ls", "--remote", "directory_store:NOT_A_STORE")
    assert wrong.returncode == 2 and "lacks the methods get, put" in wrong.stderr, wrong.stderr
    missing = cli("--root", there, "ls", "--remote", "directory_store:Nothing")
    assert missing.returncode == 2 and "directory_store has no Nothing" in missing.stderr
    for text in ("[1]", "{"):  # an option error exits 2, as every error does
        bad = cli("--root", there, "ls", "--remote", spec, "--remote-options", text)
        assert bad.returncode == 2 and "--remote-options must be" in bad.stderr, bad.stderr
