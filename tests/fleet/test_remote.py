"""The remote tier against real servers on localhost: an S3 API server (moto in server
mode, over HTTP, used through s3fs as with real S3) and a shared directory (file://).
Several processes with their own local caches share one remote: one compiles, all serve;
a remote that vanishes or holds a corrupt blob never fails a call; offline mode never
compiles."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cache_helpers import fake_artifact, get, key_of, put
from conftest import ROOT, Compiled, run_fleet, run_python
from remote_helpers import S3Server

import precompile
from precompile.cache import ArtifactCache, RemoteStore, sha256_hex
from precompile.cache import _deadline as deadline


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(params=["s3", "file"])
def remote(request: pytest.FixtureRequest, s3: S3Server, tmp_path: Any) -> dict[str, Any]:
    if request.param == "s3":
        return {"url": s3.url(), "options": s3.options}
    shared = tmp_path / "shared"
    shared.mkdir()
    return {"url": f"file://{shared}", "options": {}}


def _blob(digest: str) -> str:  # where the remote tier keeps things, in every store
    return f"blobs/{digest[:2]}/{digest}"


def _entry(key: str) -> str:
    return f"entries/{key}.json"


def _lease(key: str) -> str:
    return f"leases/{key}.json"


def _read(store: RemoteStore, name: str) -> bytes | None:
    return store.get([(name, 1 << 20)])[0]


def _cache(tmp_path: Any, name: str, remote: dict[str, Any], **kwargs: Any) -> ArtifactCache:
    return ArtifactCache(
        str(tmp_path / name), remote=remote["url"], remote_options=remote["options"], **kwargs
    )


def test_a_local_miss_is_served_from_the_remote_and_kept(
    tmp_path: Any, remote: dict[str, Any]
) -> None:
    machine_a = _cache(tmp_path, "a", remote)
    put(machine_a, key_of(1), fake_artifact(1), {"graph": "g"})
    machine_a.tag("model", key_of(1))
    assert machine_a.stats().remote_uploads == 1
    machine_b = _cache(tmp_path, "b", remote)
    assert not machine_b.contains(key_of(1))
    found = get(machine_b, key_of(1))
    assert found is not None and found[0].variants == fake_artifact(1).variants
    assert machine_b.contains(key_of(1))  # copied into the local cache
    assert machine_b.stats().remote_hits == 1
    assert machine_b.tagged("model") == key_of(1)  # tags travel too
    assert get(machine_b, key_of(2)) is None and machine_b.stats().remote_misses >= 1


def test_a_remote_entry_is_checked_like_a_local_one(tmp_path: Any, remote: dict[str, Any]) -> None:
    pytest.importorskip("cryptography")
    from precompile.cache import _signing

    keyfile = str(tmp_path / "key.pem")
    public = _signing.generate_signing_key(keyfile)
    put(_cache(tmp_path, "a", remote), key_of(1), fake_artifact(1), {})  # unsigned
    strict = _cache(tmp_path, "b", remote, trusted_keys=public)
    assert get(strict, key_of(1)) is None  # refused, not imported
    assert strict.stats().remote_errors == 1 and not strict.contains(key_of(1))
    put(_cache(tmp_path, "c", remote, signing_key=keyfile), key_of(2), fake_artifact(2), {})
    assert get(strict, key_of(2)) is not None


def test_a_corrupt_remote_blob_is_refused_removed_and_replaced(
    tmp_path: Any, remote: dict[str, Any]
) -> None:
    machine_a = _cache(tmp_path, "a", remote)
    put(machine_a, key_of(1), fake_artifact(1), {})
    store = machine_a.remote
    assert store is not None
    digest = fake_artifact(1).variants[0].payload
    store.put(_blob(digest), b"\x28\xb5\x2f\xfd garbage")
    machine_b = _cache(tmp_path, "b", remote)
    assert get(machine_b, key_of(1)) is None  # refused: never written locally
    assert not machine_b.contains(key_of(1)) and not store.exists(_blob(digest))
    put(machine_b, key_of(1), fake_artifact(1), {})  # recompiled and uploaded again
    assert get(_cache(tmp_path, "c", remote), key_of(1)) is not None


def test_a_remote_that_disappears_never_fails_a_call(tmp_path: Any) -> None:
    server = S3Server()
    remote = {"url": server.url(), "options": server.options}
    cache = _cache(tmp_path, "a", remote)
    put(cache, key_of(1), fake_artifact(1), {})
    server.stop()
    started = time.monotonic()
    put(cache, key_of(2), fake_artifact(2), {})  # stored locally, upload fails
    assert get(cache, key_of(2)) is not None
    assert get(cache, key_of(3)) is None  # a miss, not an exception
    with cache.lock(key_of(4)):  # the lease fails: single flight is local only
        pass
    cache.tag("model", key_of(2))
    assert cache.stats().remote_errors >= 3
    assert time.monotonic() - started < 60


FLEET = """
cache = ArtifactCache(sys.argv[3], remote=sys.argv[4], remote_options=json.loads(sys.argv[5]))
with torch.no_grad():
    art = precompile.standalone_compile(
        captured.gm, captured.example_inputs, hints=[64], cache=cache
    )
    x = torch.randn(50, 32)
    torch.testing.assert_close(art(*captured.flat(x))[0], model(x), rtol=1e-4, atol=1e-4)
print("compiles", len(compiles), "remote_hits", cache.stats().remote_hits)
"""


def test_four_machines_share_one_remote_and_exactly_one_compiles(
    tmp_path: Any, remote: dict[str, Any]
) -> None:
    """Four processes, four local caches, one remote: the compile lease (an O_EXCL file,
    or a conditional PUT on S3) lets one compile; the others wait and fetch its entry."""
    options = json.dumps(remote["options"])
    machines = [[str(tmp_path / f"machine-{n}"), remote["url"], options] for n in range(4)]
    outputs = run_fleet(FLEET, machines, str(tmp_path / "ready"))
    counts = sorted(int(out.split()[1]) for out in outputs)
    assert counts == [0, 0, 0, 1], outputs  # one process compiled
    assert sum(int(out.split()[3]) for out in outputs) == 3  # three fetched it


def test_offline_mode_never_compiles(mlp: Compiled, tmp_path: Any, monkeypatch: Any) -> None:
    captured = mlp.captured
    empty = ArtifactCache(str(tmp_path / "empty"))
    put(empty, key_of(1), fake_artifact(1), {"graph": "other", "torch": "x"})
    with pytest.raises(precompile.ArtifactNotFoundError, match="compiling is off") as info:
        precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=empty, compile=False
        )
    assert "differs in" in str(info.value) and isinstance(info.value, FileNotFoundError)
    monkeypatch.setenv("PRECOMPILE_OFFLINE", "1")
    with pytest.raises(precompile.ArtifactNotFoundError, match="PRECOMPILE_OFFLINE"):
        precompile.standalone_compile(captured.gm, captured.example_inputs, hints=[16], cache=empty)
    monkeypatch.delenv("PRECOMPILE_OFFLINE")
    with torch.no_grad():
        built = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=empty
        )
        again = precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=empty, compile=False
        )
    assert again.variants == built.variants  # a hit serves, offline or not
    # Outside no_grad the key differs: the refusal names the factor, not just "missing".
    # (with grad on, the key also names the backward's tracing policy)
    differs = r"differs in: (backward, )?global_state"
    with pytest.raises(precompile.ArtifactNotFoundError, match=differs):
        precompile.standalone_compile(
            captured.gm, captured.example_inputs, hints=[16], cache=empty, compile=False
        )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "precompile", "cache", *args], cwd=ROOT, capture_output=True,
        text=True,
    )  # fmt: skip


def test_cli_push_pull_and_list_the_remote(tmp_path: Any, s3: S3Server) -> None:
    url, options = s3.url(), json.dumps(s3.options)
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    store = ArtifactCache(here)
    for n in (1, 2):
        put(store, key_of(n), fake_artifact(n), {})
    store.tag("model", key_of(2))
    pushed = _cli("--root", here, "push", url, "--remote-options", options, "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert sorted(json.loads(pushed.stdout)["pushed"]) == sorted([key_of(1), key_of(2)])
    listing = _cli("--root", there, "ls", "--remote", url, "--remote-options", options, "--json")
    assert sorted(json.loads(listing.stdout)) == sorted([key_of(1), key_of(2)])
    pulled = _cli("--root", there, "pull", url, "--tag", "model", "--remote-options", options)
    assert pulled.returncode == 0, pulled.stderr
    local = ArtifactCache(there)
    assert local.contains(key_of(2)) and not local.contains(key_of(1))
    assert local.tagged("model") == key_of(2)
    assert os.path.isdir(there)
    # Pulling everything brings the remote's tags for what it pulled.
    third = str(tmp_path / "third")
    everything = _cli("--root", third, "pull", url, "--remote-options", options)
    assert everything.returncode == 0, everything.stderr
    copy = ArtifactCache(third)
    assert copy.contains(key_of(1)) and copy.tags() == {"model": key_of(2)}
    dry = _cli("--root", third, "prune", "--max-size", "0", "--dry-run")
    assert dry.returncode == 0 and "would evict 2 entries" in dry.stdout, dry.stdout + dry.stderr
    assert copy.contains(key_of(1)) and copy.contains(key_of(2))  # a dry run deletes nothing


def test_a_remote_is_opened_at_first_use_and_a_bad_url_is_refused_at_once(
    tmp_path: Any,
) -> None:
    out = run_python(
        f"""
import sys
from precompile.cache import ArtifactCache
from precompile.runtime._errors import InvalidOptionError
store = ArtifactCache({str(tmp_path / "a")!r}, remote="s3://bucket/path")
print("s3fs imported:", "s3fs" in sys.modules)  # a local hit never needs the client
for bad in ("nosuchprotocol://x", "no-scheme"):
    try:
        ArtifactCache({str(tmp_path / "b")!r}, remote=bad)
    except InvalidOptionError as exc:
        print("refused:", exc)
"""
    )
    assert "s3fs imported: False" in out, out
    assert "refused: remote 'nosuchprotocol://x' cannot be opened" in out, out
    assert "refused: remote must be a URL" in out, out


HOSTILE_LEASES = [
    b'{"owner": "x", "expires": 1e18}',  # a lease that would never expire
    b'{"owner": "x", "expires": NaN}',  # json.loads takes NaN and Infinity
    b'{"owner": "x", "expires": Infinity}',
    b'{"owner": "x", "expires": 1e400}',
    b'{"owner": "x", "expires": 1' + b"0" * 400 + b"}",  # an int past a float's range
    b'{"owner": "x", "expires": -1}',
    b'{"owner": "x", "expires": "tomorrow"}',
    b'{"owner": "x", "expires": true}',
    b'{"owner": "x"}',
    b"[]",
]


def test_a_lease_holds_a_key_no_longer_than_a_lease_lives(
    tmp_path: Any, remote: dict[str, Any]
) -> None:
    """A lease object whose expiry is not a time within a lease's lifetime from now is
    expired: the next compile takes it over at once instead of waiting out lock_timeout."""
    cache = _cache(tmp_path, "a", remote, lock_timeout=3.0)
    store = cache.remote
    assert store is not None
    for n, body in enumerate(HOSTILE_LEASES):
        key = key_of(100 + n)
        store.put(_lease(key), body)
        started = time.monotonic()
        with cache.lock(key):
            held = json.loads(_read(store, _lease(key)) or b"{}")
        assert time.monotonic() - started < 2.0, body
        assert held.get("owner") == cache._tier.owner, body  # type: ignore[union-attr]
        assert not store.exists(_lease(key))  # taken over, not waited out, and released
    # An honest lease of another machine is waited for (up to lock_timeout), not taken.
    honest = _cache(tmp_path, "b", remote, lock_timeout=0.5)
    key = key_of(99)
    other = {"owner": "another-machine", "expires": time.time() + 600}
    store.put(_lease(key), json.dumps(other).encode())
    started = time.monotonic()
    with honest.lock(key):
        held = json.loads(_read(store, _lease(key)) or b"{}")
    assert held == other and time.monotonic() - started >= 0.5


def test_calls_left_behind_by_their_deadline_are_bounded_and_cleaned_up() -> None:
    """A call past its deadline keeps its daemon thread until its request ends; past
    MAX_LEFT_BEHIND of them new calls fail at once, and a late result reaches on_late."""
    release = threading.Event()
    late: list[str] = []
    room = deadline.MAX_LEFT_BEHIND - deadline.left_behind()
    assert room > 0
    outcomes = []
    started = time.monotonic()
    for _ in range(room + 3):
        try:
            deadline.call(lambda: (release.wait(30), "lease")[1], 0.05, "test", late.append)
        except deadline.RemoteTimeout as exc:
            outcomes.append(str(exc))
    assert time.monotonic() - started < room * 0.05 + 2.0  # the last 3 did not wait
    assert [o.startswith("no answer within") for o in outcomes] == [True] * room + [False] * 3
    assert deadline.left_behind() == deadline.MAX_LEFT_BEHIND
    release.set()  # the requests end: their threads end, their late results are handed on
    for _ in range(200):
        if deadline.left_behind() == deadline.MAX_LEFT_BEHIND - room:
            break
        time.sleep(0.01)
    assert deadline.left_behind() == deadline.MAX_LEFT_BEHIND - room and late == ["lease"] * room
    assert deadline.call(lambda: 7, 1.0, "test") == 7  # and calls wait again
    with pytest.raises(ZeroDivisionError):  # an error is the caller's, raised in its thread
        deadline.call(lambda: 1 // 0, 1.0, "test")


class SilentServer:
    """Takes TCP connections on a loopback port and never answers: a hung server."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(connection)  # kept open, never read, never answered

    def options(self) -> dict[str, Any]:
        # The client's own defaults (timeouts, retries), as a user would have them.
        endpoint = f"http://127.0.0.1:{self.port}"
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def close(self) -> None:
        self.sock.close()
        for connection in self.held:
            connection.close()


def test_a_server_that_never_answers_costs_the_deadline_not_minutes(tmp_path: Any) -> None:
    server = SilentServer()
    try:
        cache = ArtifactCache(
            str(tmp_path / "a"), remote="s3://fleet/x", remote_options=server.options(),
            remote_timeout=0.5,
        )  # fmt: skip
        took: dict[str, float] = {}

        def timed(name: str, action: Any) -> Any:
            started = time.monotonic()
            result = action()
            took[name] = time.monotonic() - started
            return result

        # the first remote call imports and builds the S3 client (seconds on a loaded
        # 2-core machine): made untimed, so the bounds below are the deadline's own
        assert get(cache, key_of(0)) is None
        assert timed("get", lambda: get(cache, key_of(1))) is None  # a miss, served locally

        def lock() -> None:
            with cache.lock(key_of(2)):  # the lease is given up on: single flight is local
                pass

        timed("lock", lock)
        artifact = fake_artifact(3)
        timed("put", lambda: put(cache, key_of(3), artifact, {}))  # the upload is abandoned
        timed("tag", lambda: cache.tag("model", key_of(3)))
        assert timed("tagged", lambda: cache.tagged("absent")) is None
        assert get(cache, key_of(3)) is not None  # the local write stands
        assert max(took.values()) < 0.5 + 1.5, took
        stats = cache.stats()
        assert stats.remote_timeouts >= 4 and stats.remote_errors >= stats.remote_timeouts, stats
        # A process that met the silent server exits at once: no thread it left holds it.
        script = f"""
            import time
            from precompile.cache import ArtifactCache
            cache = ArtifactCache({str(tmp_path / "b")!r}, remote="s3://fleet/x",
                                  remote_options={server.options()!r}, remote_timeout=0.5)
            started = time.monotonic()
            print("found", cache.get({key_of(1)!r}), "after", round(time.monotonic() - started, 1))
        """
        started = time.monotonic()
        out = run_python(script, timeout=60)
        assert "found None" in out and time.monotonic() - started < 30, out
    finally:
        server.close()


def test_an_entry_that_lies_about_a_blob_never_removes_it(
    tmp_path: Any, remote: dict[str, Any]
) -> None:
    """Anyone who can write one entry must not be able to delete others' blobs: a blob
    leaves the remote only when its own bytes fail its own digest."""
    machine_a = _cache(tmp_path, "a", remote)
    put(machine_a, key_of(1), fake_artifact(1), {})
    store = machine_a.remote
    assert store is not None
    document = json.loads(_read(store, _entry(key_of(1))) or b"{}")
    digest = fake_artifact(1).variants[0].payload
    for n, off_by in enumerate((1, -1)):  # the size listed off by one, either way
        key = key_of(2 + n)
        lie = {**document, "key": key, "blobs": {digest: document["blobs"][digest] + off_by}}
        store.put(_entry(key), json.dumps(lie).encode())
        reader = _cache(tmp_path, f"b{n}", remote)
        assert get(reader, key) is None  # the lying entry is refused
        assert reader.stats().remote_errors == 1
        assert store.exists(_blob(digest))  # and the healthy blob stays
    assert get(_cache(tmp_path, "c", remote), key_of(1)) is not None  # a new machine hits


def test_an_entry_asking_too_much_is_refused_before_any_blob_request(
    tmp_path: Any, remote: dict[str, Any]
) -> None:
    """Each blob an entry lists is one request: a hostile entry listing thousands (or
    declaring gigabytes) is refused from its blob table alone."""
    cache = _cache(tmp_path, "a", remote)
    store = cache.remote
    assert store is not None
    many = {sha256_hex(str(n).encode()): 10 for n in range(5000)}
    large = {sha256_hex(b"a"): 3 << 30, sha256_hex(b"b"): 3 << 30}  # 6 GiB in all
    for n, blobs in enumerate((many, large)):
        key = key_of(10 + n)
        entry = {"key": key, "layout": "v2", "factors": {}, "blobs": blobs, "aux": {}}
        store.put(_entry(key), json.dumps({**entry, "document": None}).encode())
    requested: list[str] = []
    read = store.get

    def counting(wanted: Any) -> Any:
        requested.extend(name for name, _ in wanted)
        return read(wanted)

    store.get = counting  # type: ignore[method-assign]
    assert get(cache, key_of(10)) is None and get(cache, key_of(11)) is None
    assert requested == [_entry(key_of(10)), _entry(key_of(11))]
    assert cache.stats().remote_errors == 2


def test_cli_skips_and_reports_names_that_are_not_keys(tmp_path: Any) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    url = f"file://{shared}"
    here = str(tmp_path / "here")
    store = ArtifactCache(here, remote=url)
    for n in (1, 2, 3):
        put(store, key_of(n), fake_artifact(n), {})  # uploaded as written
    store.tag("model", key_of(2))
    remote = store.remote
    assert remote is not None
    bad = ["z" * 64, "0" * 10, "\x1b[31m" + "a" * 59]  # the last one colours a terminal
    for name in bad:  # sorted before, between and after the good names
        remote.put(_entry(name), b"{}")
    keys = sorted(key_of(n) for n in (1, 2, 3))
    listing = _cli("--root", str(tmp_path / "x"), "ls", "--remote", url, "--json")
    assert listing.returncode == 0, listing.stderr
    assert json.loads(listing.stdout) == keys and repr("z" * 64) in listing.stderr
    there = str(tmp_path / "there")
    pulled = _cli("--root", there, "pull", url, "--json")
    assert pulled.returncode == 0, pulled.stderr
    report = json.loads(pulled.stdout)
    assert sorted(report["pulled"]) == keys and report["failed"] == 0, report
    assert sorted(s["name"] for s in report["skipped"]) == sorted(bad), report
    assert repr(bad[2]) in pulled.stderr and "\x1b" not in pulled.stderr
    assert ArtifactCache(there).tags() == {"model": key_of(2)}  # tags still pulled
    # push: a local entry that cannot be read is skipped and reported; the rest goes.
    os.chmod(store.entry_path(key_of(1)), 0o666)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pushed = _cli("--root", here, "push", f"file://{elsewhere}", "--json")
    assert pushed.returncode == 0, pushed.stderr
    report = json.loads(pushed.stdout)
    assert sorted(report["pushed"]) == sorted([key_of(2), key_of(3)]), report
    assert [s["name"] for s in report["skipped"]] == [key_of(1) + ".json"], report
    assert "UnsafeCacheError" in report["skipped"][0]["reason"] and key_of(1) in pushed.stderr


def test_cli_failures_exit_non_zero_naming_their_cause(tmp_path: Any) -> None:
    """A remote that cannot be listed (a missing directory, an unreachable store), a tag
    that does not exist and a remote given as a plain path: each exits non-zero with one
    line saying why, never "0 entries" and exit 0. A failed listing changes nothing in
    the local cache (``ls`` is read-only): its stats count no remote error."""
    root = str(tmp_path / "here")
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {})
    stats = ArtifactCache(root).stats()
    missing = f"file://{tmp_path / 'nowhere'}"
    for args in (["ls", "--remote", missing], ["pull", missing]):
        done = _cli("--root", root, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "does not exist" in done.stderr and "0 entries" not in done.stdout, done.stderr
    # an unreachable store: nothing listens on this port
    options = json.dumps({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                          "key": "x", "secret": "y", "config_kwargs": {
                              "connect_timeout": 1, "retries": {"max_attempts": 1}}})  # fmt: skip
    done = _cli("--root", root, "ls", "--remote", "s3://nonexistent-bucket/x",
                "--remote-options", options)  # fmt: skip
    assert done.returncode == 2 and "listing s3://nonexistent-bucket/x failed" in done.stderr, (
        done.stdout,
        done.stderr,
    )
    assert ArtifactCache(root).stats() == stats
    shared = tmp_path / "shared"
    shared.mkdir()
    done = _cli("--root", root, "push", f"file://{shared}", "--tag", "no-such-tag")
    assert done.returncode == 2 and "no tag 'no-such-tag'" in done.stderr, done.stderr
    done = _cli("--root", root, "push", str(shared))
    assert done.returncode == 2 and f"file://{shared}" in done.stderr, done.stderr
    # an empty remote that exists is not an error
    done = _cli("--root", root, "ls", "--remote", f"file://{shared}")
    assert done.returncode == 0 and "0 entries" in done.stdout, done.stderr


def test_pull_reads_the_remote_and_writes_only_here(tmp_path: Any) -> None:
    """``pull --tag`` takes the tag the remote holds: from a remote that does not exist it
    exits 2 naming it (never "pulled 1 entries" from a local tag, never making the
    remote's directory or writing a tag into it); a tag the remote lacks is named with
    the remote. A failure is said once, on one line."""
    root = str(tmp_path / "here")
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {})
    store.tag("served", key_of(1))
    missing = tmp_path / "nowhere"
    done = _cli("--root", root, "pull", "--tag", "served", f"file://{missing}")
    assert done.returncode == 2 and "does not exist" in done.stderr, (done.stdout, done.stderr)
    assert not missing.exists()
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    shared = tmp_path / "shared"
    shared.mkdir()
    done = _cli("--root", root, "pull", "--tag", "served", f"file://{shared}")
    assert done.returncode == 2 and f"no tag 'served' in file://{shared}" in done.stderr
    assert list(shared.rglob("*tags*/*")) == []  # nothing written to the remote
    # the round trip: a tag pushed is pulled into a fresh cache, named there
    assert _cli("--root", root, "push", "--tag", "served", f"file://{shared}").returncode == 0
    fresh = str(tmp_path / "fresh")
    done = _cli("--root", fresh, "pull", "--tag", "served", f"file://{shared}")
    assert done.returncode == 0 and "pulled 1 entries" in done.stdout, done.stderr
    assert ArtifactCache(fresh).tags() == {"served": key_of(1)}
