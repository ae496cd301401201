"""The cache as an unlucky operator meets it: racing writers and evictions, read-only
and full disks, files of other users, leftovers of killed writers, a shared build dir,
forked workers. Real processes, real mounts (in a user namespace) and real files."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from cache_helpers import fake_artifact, get, key_of, put
from conftest import ROOT, Compiled, run_python

import precompile
from precompile.cache import ArtifactCache


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
    )
    return probe.returncode == 0


needs_namespace = pytest.mark.skipif(
    not _can_unshare(), reason="needs unshare (user and mount namespaces) for a real mount"
)


def _in_namespace(shell: str, script: str, *args: str, timeout: int = 300) -> str:
    """Run ``shell`` (mount commands) then ``python -c script args`` in a user+mount
    namespace: mounts made there are real and vanish with it."""
    quoted = " ".join(f"'{a}'" for a in args)
    command = f'{shell} && exec {sys.executable} -c "$SCRIPT" {quoted}'
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "SCRIPT": textwrap.dedent(script)},
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


RACER = """
import random, sys
sys.path.insert(0, "tests")
from precompile.cache import ArtifactCache
from precompile._standalone import _cached_or_built
from cache_helpers import fake_artifact, get, key_of, put
root, seed, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = ArtifactCache(root, size_limit=limit, lock_timeout=60)
rng = random.Random(seed)
hits = 0
for i in range(40):
    n = rng.randrange(10)
    if rng.random() < 0.5:
        put(store, key_of(n), fake_artifact(n, size=20_000), {})
    else:
        _cached_or_built(store, key_of(n), {}, lambda: (fake_artifact(n, size=20_000), []))
    hits += get(store, key_of(rng.randrange(10))) is not None
    if rng.random() < 0.2:
        store.prune()
print("done", hits)
"""


def _race(script: str, root: str) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]]:
    """Eight processes running ``script`` on the cache at ``root`` at once (seeds 0-7,
    5000 operations each); each process and its (stdout, stderr)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, root, str(seed), str(5_000)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(8)
    ]
    return procs, [p.communicate(timeout=600) for p in procs]


def test_racing_writers_and_evictions_lose_nothing_healthy(tmp_path: Any) -> None:
    """8 processes write, read and evict over a cache that holds about 3 entries. A write
    in flight keeps its blobs (writers hold the gc lock shared); a file vanishing under
    a scan or a read is a miss; no healthy entry is ever quarantined; nobody deadlocks
    (prune takes no key lock)."""
    root = str(tmp_path)
    ArtifactCache(root)
    started = time.monotonic()
    procs, outputs = _race(RACER, root)
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0 and "done" in out, err[-3000:]
    assert time.monotonic() - started < 300
    store = ArtifactCache(root)
    assert os.listdir(os.path.join(root, "v2", "quarantine")) == []
    assert store.stats().corrupt == 0
    assert store.stats().evictions > 0  # the limit was hit: eviction really raced
    for entry in store.entries():
        assert get(store, entry.key) is not None


READ_ONLY = """
import logging, sys
sys.path.insert(0, "tests")
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("precompile").addHandler(Keep())
logging.getLogger("precompile").setLevel(logging.INFO)
import precompile
from precompile.cache import ArtifactCache
from precompile._standalone import _cached_or_built
from cache_helpers import fake_artifact, get, key_of
store = ArtifactCache(sys.argv[1])
print("writable", store.writable)
art, _ = get(store, key_of(1))
print("hit", art.cache_key == key_of(1))
print("by tag", precompile.CompiledArtifact.load(tag="model", cache=store).cache_key == key_of(1))
print("stats", store.stats().entries, store.stats().writable)
built = _cached_or_built(store, key_of(2), {}, lambda: (fake_artifact(2), []))
print("miss compiled", built[0].variants == fake_artifact(2).variants, store.contains(key_of(2)))
print("warned", any("read-only" in r or "cannot" in r for r in records))
print("verify", store.verify().ok)
"""


@needs_namespace
def test_a_read_only_cache_serves_hits(tmp_path: Any) -> None:
    root = str(tmp_path / "cache")
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {"graph": "g"})
    store.tag("model", key_of(1))
    mount = f"mount --bind {root} {root} && mount -o remount,bind,ro {root}"
    out = _in_namespace(mount, READ_ONLY, root)
    for line in [
        "writable False",
        "hit True",
        "by tag True",
        "stats 1 False",
        "miss compiled True False",
        "warned True",
        "verify True",
    ]:
        assert line in out, out
    cli = """
import subprocess, sys
for args in (["ls"], ["verify"], ["stats"], ["prune"], ["clear", "--yes"],
             ["plan", "prune", "--max-size", "0", "--dry-run"]):
    name, args = (args[0], args[1:]) if args[0] == "plan" else (args[0], args)
    r = subprocess.run([sys.executable, "-m", "precompile", "cache", "--root", sys.argv[1], *args],
                       capture_output=True, text=True)
    print(name, r.returncode, "Traceback" in r.stderr, (r.stdout + r.stderr).strip()[-90:])
"""
    out = _in_namespace(mount, cli, root)
    lines = {line.split()[0]: line for line in out.strip().splitlines()}
    assert lines["ls"].startswith("ls 0 False") and "read-only" in lines["ls"]
    assert lines["verify"].startswith("verify 0 False")
    assert lines["stats"].startswith("stats 0 False")
    for action in ("prune", "clear"):
        assert lines[action].startswith(f"{action} 1 False"), lines[action]
        assert "read-only" in lines[action]
    # a dry run only reads: it plans on a read-only cache too (it was refused, exit 1)
    assert lines["plan"].startswith("plan 0 False") and "(limit 0 B)" in lines["plan"]


FULL_DISK = """
import logging, os, sys
sys.path.insert(0, "tests")
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("precompile").addHandler(Keep())
import precompile
from precompile.cache import ArtifactCache
from precompile._standalone import _cached_or_built
from cache_helpers import fake_artifact, key_of, put, random_artifact
store = ArtifactCache(sys.argv[1])
big = random_artifact(3_000_000)  # incompressible: more than the disk holds
try:
    put(store, key_of(5), big, {})
    print("stored?!")
except precompile.CacheWriteError as exc:
    print("refused", isinstance(exc, OSError), exc.errno)
built, _ = _cached_or_built(store, key_of(5), {}, lambda: (big, []))
print("returned", built is big, "warned", any("could not store" in r for r in records))
left = [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs
        if "/locks/" not in os.path.join(d, f) and not f.endswith(("CACHEDIR.TAG", "stats.json"))]
print("left", left)
put(store, key_of(6), fake_artifact(6), {})
print("small entry fits", store.contains(key_of(6)))
"""


@needs_namespace
def test_a_full_disk_returns_the_compiled_artifact_and_leaves_no_partial_entry(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "cache")
    os.makedirs(root)
    out = _in_namespace(f"mount -t tmpfs -o size=1m tmpfs {root}", FULL_DISK, root)
    assert "refused True" in out and "28" in out, out  # ENOSPC
    assert "returned True warned True" in out, out
    assert "left []" in out, out
    assert "small entry fits True" in out, out


FILE_SIZE_LIMIT = """
import os, resource, signal, sys
sys.path.insert(0, "tests")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import precompile
from precompile.cache import ArtifactCache
from cache_helpers import key_of, put, random_artifact
store = ArtifactCache(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))
try:
    put(store, key_of(5), random_artifact(3_000_000), {})
except precompile.CacheWriteError as exc:
    print("refused", exc.errno)
blobs = sum(len(names) for _, _, names in os.walk(sys.argv[1] + "/v2/blobs"))
print("entries", len(store.entries()), "blobs", blobs)
"""


def test_a_write_the_filesystem_refuses_leaves_nothing(tmp_path: Any) -> None:
    """The same without a mount: the OS refuses the write past RLIMIT_FSIZE (EFBIG)."""
    out = run_python(FILE_SIZE_LIMIT.replace("sys.argv[1]", repr(str(tmp_path))))
    assert "refused 27" in out and "entries 0 blobs 0" in out, out


def test_directories_others_can_write_are_refused(tmp_path: Any) -> None:
    root = str(tmp_path / "c")
    ArtifactCache(root)
    os.chmod(root + "/v2/entries", 0o777)
    with pytest.raises(precompile.UnsafeCacheError, match="writable by group/others"):
        ArtifactCache(root)
    assert ArtifactCache(root, trust_foreign=True).writable
    os.chmod(root + "/v2/entries", 0o700)
    if os.getuid() == 0:
        os.chown(root + "/v2", 65534, 65534)
        with pytest.raises(precompile.UnsafeCacheError, match="owned by uid 65534"):
            ArtifactCache(root)
        os.chown(root + "/v2", 0, 0)


def test_a_cache_root_others_can_write_is_refused(tmp_path: Any) -> None:
    """Whoever can write the root can swap ``v2/`` for a tree of theirs: the root is
    checked like the directories in it, before anything is written into it."""
    root = str(tmp_path / "c")
    os.makedirs(root)
    os.chmod(root, 0o777)
    with pytest.raises(precompile.UnsafeCacheError, match=f"cache root {root} .*group/others"):
        ArtifactCache(root)
    assert not os.path.exists(os.path.join(root, "v2"))  # refused before it was written
    assert ArtifactCache(root, trust_foreign=True).writable
    os.chmod(root, 0o1777)  # sticky, like /tmp or a tmpfs mount: others cannot move v2/
    assert ArtifactCache(root).writable
    os.chmod(root, 0o700)
    assert ArtifactCache(root).writable
    link = str(tmp_path / "link")
    os.symlink(root, link)  # where the cache lives is the caller's choice: a link is followed
    assert ArtifactCache(link).writable
    if os.getuid() == 0:
        os.chown(root, 65534, 65534)
        with pytest.raises(precompile.UnsafeCacheError, match="owned by uid 65534"):
            ArtifactCache(link)
        os.chown(root, 0, 0)


def test_links_and_foreign_entries_are_refused_and_the_cli_says_so(tmp_path: Any) -> None:
    root = str(tmp_path)
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {})
    put(store, key_of(2), fake_artifact(2), {})
    elsewhere = str(tmp_path / "elsewhere.json")
    shutil.move(store.entry_path(key_of(1)), elsewhere)
    os.symlink(elsewhere, store.entry_path(key_of(1)))
    with pytest.raises(precompile.UnsafeCacheError, match="symbolic link"):
        get(store, key_of(1))
    os.chmod(store.entry_path(key_of(2)), 0o666)
    with pytest.raises(precompile.UnsafeCacheError, match="writable by group/others"):
        get(store, key_of(2))
    for action in (["verify"], ["ls"], ["info", key_of(2)[:8]]):
        result = subprocess.run(
            [sys.executable, "-m", "precompile", "cache", "--root", root, *action],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert "Traceback" not in result.stderr, result.stderr
        assert "could not" in result.stdout + result.stderr or "UnsafeCacheError" in result.stderr


FOREIGN_RACER = """
import os, sys, time
os.setgid(65534); os.setuid(65534)
entries, key, stop = sys.argv[1], sys.argv[2], float(sys.argv[3])
target = os.path.join(entries, key + ".json")
n = 0
while time.time() < stop:
    tmp = os.path.join(entries, f".evil-{n}")
    with open(tmp, "w") as handle:
        handle.write('{"evil": true}')
    os.chmod(tmp, 0o644)
    try:
        os.replace(tmp, target)
    except OSError:
        pass
    n += 1
print("swaps", n)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs a second user to race (runs as root)")
def test_a_racing_file_of_another_user_is_never_read(tmp_path: Any) -> None:
    """The owner check is made on the opened descriptor: a file another user swaps in
    between the check and the read cannot slip through (with stat-then-open, 108 of
    20,000 reads did)."""
    import tempfile

    base = tempfile.mkdtemp(prefix="precompile-race-", dir="/tmp")  # reachable by nobody
    root = os.path.join(base, "c")
    store = ArtifactCache(root)
    put(store, key_of(1), fake_artifact(1), {})
    for part in (base, root, root + "/v2"):
        os.chmod(part, 0o755)
    os.chmod(root + "/v2/entries", 0o777)  # made unsafe after the cache checked it
    stop = time.time() + 6
    racer = subprocess.Popen(
        [sys.executable, "-c", FOREIGN_RACER, root + "/v2/entries", key_of(1), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ours = refused = missed = 0
    while time.time() < stop:
        try:
            found = store.get(key_of(1))
        except precompile.UnsafeCacheError:
            refused += 1
            continue
        if found is None:
            missed += 1
            put(store, key_of(1), fake_artifact(1), {})
        else:
            assert found.key == key_of(1) and found.document is not None
            ours += 1
    out, _ = racer.communicate(timeout=60)
    quarantined = os.listdir(root + "/v2/quarantine")
    shutil.rmtree(base, ignore_errors=True)
    assert int(out.split()[1]) > 100, out
    assert refused > 0 and ours > 0, (ours, refused, missed)
    assert quarantined == []  # no foreign bytes were ever read, not even to be rejected


def test_temp_files_of_killed_writers_count_and_are_collected(tmp_path: Any) -> None:
    store = ArtifactCache(str(tmp_path))
    put(store, key_of(1), fake_artifact(1), {})
    before = store.total_size()
    old = os.path.join(str(tmp_path), "v2", "blobs", ".precompile-dead.tmp")
    young = os.path.join(str(tmp_path), "v2", "entries", ".precompile-live.tmp")
    for path in (old, young):
        with open(path, "wb") as handle:
            handle.write(bytes(10_000))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert store.total_size() == before + 20_000  # they count toward the limit
    plan = store.prune(dry_run=True)
    assert plan.temp_files == (old,) and plan.bytes_freed == 10_000 and os.path.exists(old)
    store.prune()
    assert not os.path.exists(old) and os.path.exists(young)  # a live writer's temp stays
    assert get(store, key_of(1)) is not None


BUILD_DIR = """
import logging, os, sys, torch, precompile
sys.path.insert(0, "tests")
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("precompile").addHandler(Keep())
art = precompile.CompiledArtifact.load(path=sys.argv[1])
c = torch.load(sys.argv[2])
for flat, want in zip(c["args"], c["expected"]):
    torch.testing.assert_close(art(*flat)[0], want, rtol=1e-4, atol=1e-4)
print("correct")
print("replaced", sum("does not match its sha256" in r for r in records))
"""


def test_a_planted_kernel_in_a_shared_build_dir_is_replaced(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any
) -> None:
    from test_warm_start import cases

    build = str(tmp_path / "build")
    os.makedirs(os.path.join(build, "kernels"), mode=0o700)
    os.chmod(build, 0o700)
    for digest in mlp.artifact.manifest.kernel_digests:
        with open(os.path.join(build, "kernels", f"{digest}.so"), "wb") as handle:
            handle.write(b"\x7fELF planted")
    script = BUILD_DIR
    out = run_python(
        script.replace("sys.argv[1]", repr(saved["binary"])).replace(
            "sys.argv[2]", repr(cases(mlp, str(tmp_path)))
        ),
        env={"PRECOMPILE_BUILD_DIR": build},
    )
    assert "correct" in out and "replaced 0" not in out, out
    os.chmod(build, 0o777)
    with pytest.raises(AssertionError, match=r"UnsafeCacheError.*PRECOMPILE_BUILD_DIR"):
        run_python(
            script.replace("sys.argv[1]", repr(saved["binary"])).replace(
                "sys.argv[2]", repr(cases(mlp, str(tmp_path)))
            ),
            env={"PRECOMPILE_BUILD_DIR": build},
        )


def test_a_build_dir_under_a_missing_parent_is_refused(tmp_path: Any) -> None:
    """PRECOMPILE_BUILD_DIR creates its last component only (a client trial's typo created
    /nonexistent, mode 755, and used it)."""
    missing = os.path.join(str(tmp_path), "missing", "build")
    with pytest.raises(AssertionError, match=r"InvalidOptionError.*parent directory"):
        run_python(
            "from precompile.runtime._build_dir import build_dir\nbuild_dir()\n",
            env={"PRECOMPILE_BUILD_DIR": missing},
        )
    assert not os.path.exists(os.path.dirname(missing))
    made = os.path.join(str(tmp_path), "build")
    run_python("from precompile.runtime._build_dir import build_dir\nprint(build_dir())\n",
               env={"PRECOMPILE_BUILD_DIR": made})  # fmt: skip
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


FORK = """
import os, sys, torch, precompile
from precompile.runtime._build_dir import build_dir
art = precompile.CompiledArtifact.load(path=sys.argv[1])
c = torch.load(sys.argv[2])
args, expected = c["args"], c["expected"]
torch.testing.assert_close(art(*args[0])[0], expected[0], rtol=1e-4, atol=1e-4)
mine = build_dir()
pid = os.fork()
if pid == 0:  # a worker: uses the artifact, then exits normally (atexit handlers run)
    torch.testing.assert_close(art(*args[1])[0], expected[1], rtol=1e-4, atol=1e-4)
    print("child dir differs", build_dir() != mine, flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
print("parent dir survives", os.path.isdir(mine))
for flat, want in zip(args[2:], expected[2:]):  # more variants load from the parent's dir
    torch.testing.assert_close(art(*flat)[0], want, rtol=1e-4, atol=1e-4)
print("parent still loads")
"""


def test_a_forked_worker_does_not_remove_its_parents_build_dir(
    mlp: Compiled, saved: dict[str, str], tmp_path: Any
) -> None:
    from test_warm_start import cases

    path = cases(mlp, str(tmp_path), sizes=[1, 5, 100, 3000, 8])
    out = run_python(
        FORK.replace("sys.argv[1]", repr(saved["binary"])).replace("sys.argv[2]", repr(path)),
        env={"PRECOMPILE_BUILD_DIR": ""},  # each process's private dir, not the tests' shared one
    )
    assert "child dir differs True" in out, out
    assert "parent dir survives True" in out and "parent still loads" in out, out


LAZY_RACER = """
import random, sys, time
sys.path.insert(0, "tests")
from precompile.cache import ArtifactCache, CorruptArtifactError
from cache_helpers import fake_artifact, key_of, put
root, seed, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = ArtifactCache(root, size_limit=limit, lock_timeout=60)
rng = random.Random(seed)
read = errors = 0
for i in range(40):
    n = rng.randrange(6)
    put(store, key_of(n), fake_artifact(n, size=20_000), {})
    entry = store.get(key_of(rng.randrange(6)), lazy=True)
    store.prune()  # others evict too, between this load and its reads
    time.sleep(rng.random() * 0.01)
    if entry is None:
        continue
    for digest in entry.blobs:
        try:
            entry.blobs[digest]
            read += 1
        except CorruptArtifactError as exc:
            errors += 1
            print("error", exc, file=sys.stderr)
print("done", read, errors)
"""


def test_a_loaded_entry_keeps_its_blobs_while_others_evict_them(tmp_path: Any) -> None:
    """8 processes load entries lazily while they all evict under a tiny size limit: a
    load's blobs read after an eviction are still its bytes (11 such reads failed with
    "was removed after the entry was read" at call time, after a successful load), and
    no healthy blob is quarantined."""
    root = str(tmp_path)
    ArtifactCache(root)
    procs, outputs = _race(LAZY_RACER, root)
    reads = 0
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0 and "done" in out, err[-3000:]
        _, read, errors = out.split()[-3:]
        assert int(errors) == 0, err[-3000:]
        reads += int(read)
    assert reads > 0
    store = ArtifactCache(root)
    assert os.listdir(os.path.join(root, "v2", "quarantine")) == []
    assert store.stats().evictions > 0
