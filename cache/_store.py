"""ArtifactCache: content-addressed entries on disk, shared safely between processes.

    <root>/CACHEDIR.TAG
    <root>/v2/entries/<key>.json     the entry document: what its writer stored, its key
                                     factors, and every blob it references with its size
    <root>/v2/blobs/<d[:2]>/<d>      zstd-compressed bytes named by sha256 of the raw bytes
    <root>/v2/locks/                 flock files (see ``_locks`` for the one lock order)
    <root>/v2/quarantine/            entries and blobs that failed verification
    <root>/v2/tags/<name>            names of entries

The cache stores bytes and documents; it never builds an artifact (the runtime does).
Writes are atomic (temp file in the same dir, ``os.replace``) and ordered blobs first,
entry last, under the shared gc lock, so collection never sees half a write. A failed
write (full or read-only disk) removes what it added and raises ``CacheWriteError``.
Every read is bounded and checked (sha256 and size of each blob, owner and mode of every
file); a corrupt entry is quarantined and reported as a miss; a file evicted mid-read is
a plain miss. Stats and LRU touches are best effort, so a read-only cache serves hits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from . import _deadline as deadline
from . import _files as files
from . import _locks as locks
from . import _signing as signing
from ._bytes import (
    atomic_file,
    check_payload_size,
    compress,
    decompress,
    fails_own_digest,
    read_fd,
    sha256_hex,
)
from ._counters import Counters
from ._entry import (
    CacheEntry,
    CacheScan,
    CacheStats,
    MissExplanation,
    PrunePlan,
    RemoteScan,
    StoredEntry,
    VerifiedBlobs,
    VerifyReport,
)
from ._errors import (
    CacheRootError,
    CacheWriteError,
    CorruptArtifactError,
    InvalidOptionError,
    PayloadLimitError,
    UnsafeCacheError,
    UntrustedArtifactError,
)
from ._json import decode_json
from ._remote import Lease, RemoteTier, remote_from_env
from ._root import LAYOUT, prepare, resolve_root
from ._settings import env_bytes
from ._signing import Signature, TrustedKeysOption, resolve_trusted_keys
from ._tags import Tags

# An entry's blobs are read in threads when they hold at least this many bytes together.
_PARALLEL_READ_BYTES = 8 << 20

log = logging.getLogger("precompile.cache")
DEFAULT_SIZE_LIMIT = 20 * 2**30
_TEMP_GRACE_S = 600.0  # a temp file this old belongs to a writer that died
_MAX_ENTRY_BYTES = 64 << 20
_HEX = frozenset("0123456789abcdef")
_ABOUT_ITEMS, _ABOUT_NAME, _ABOUT_TEXT = 32, 64, 4096  # an entry's ``about``: small, plain
# What one remote entry may ask for, checked before any of its blobs is requested: each
# blob is one request, and all of them are held in memory until verified. Real entries
# list tens of blobs (variants and kernel binaries) and megabytes.
REMOTE_ENTRY_MAX_BLOBS = 1024
REMOTE_ENTRY_MAX_BYTES = 4 << 30


def _size_limit_from_env() -> int:
    return env_bytes("PRECOMPILE_CACHE_SIZE_LIMIT", DEFAULT_SIZE_LIMIT)


def _is_digest(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 64 and set(text) <= _HEX


def _is_about(value: Any) -> bool:
    """Whether ``value`` is an entry's ``about``: a small table of plain text."""
    return (
        isinstance(value, dict)
        and len(value) <= _ABOUT_ITEMS
        and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= _ABOUT_NAME
            and len(v) <= _ABOUT_TEXT
            for k, v in value.items()
        )
    )  # fmt: skip


def _signed_digest(document: Mapping[str, Any]) -> bytes:
    """What an entry's signature signs: sha256 of its canonical JSON, signature aside."""
    body = {k: v for k, v in document.items() if k != "signature"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return bytes.fromhex(sha256_hex(text.encode()))


def _stored(
    key: str,
    document: Mapping[str, Any],
    blobs: Mapping[str, bytes],
    payloads: VerifiedBlobs | None = None,
) -> StoredEntry:
    aux_digests = set(document["aux"].values())
    return StoredEntry(
        key=key,
        document=document.get("document"),
        blobs=payloads
        if payloads is not None
        else {d: blobs[d] for d in document["blobs"] if d not in aux_digests},
        aux={name: blobs[d] for name, d in document["aux"].items()},
        factors=document.get("factors", {}),
    )


class ArtifactCache:
    """A directory of compiled artifacts keyed by everything that changes their code.

    ``size_limit``: bytes kept before LRU eviction (``$PRECOMPILE_CACHE_SIZE_LIMIT``,
    default 20 GiB). ``trust_foreign``: accept files another user owns or others may
    write (by default refused: loading runs their code). ``lock_timeout``: seconds to
    wait for another process's lock. ``trusted_keys``: public keys an entry must be
    signed by (default ``$PRECOMPILE_TRUSTED_KEYS``; none: signatures not required).
    ``signing_key``: a private key that signs every entry this cache writes.
    ``remote``: a second tier, any fsspec URL (``s3://bucket/precompile``, ``file://``
    on a shared mount; default ``$PRECOMPILE_REMOTE_CACHE``), with ``remote_options``
    for fsspec (default ``$PRECOMPILE_REMOTE_CACHE_OPTIONS``, JSON): a local miss is
    looked up there and copied in, and every write is uploaded. ``remote_timeout``:
    seconds any one remote operation may take (default ``$PRECOMPILE_REMOTE_TIMEOUT``,
    else 5), plus 1 s per 8 MiB it transfers; past it the call goes on locally.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        size_limit: int | None = None,
        trust_foreign: bool = False,
        lock_timeout: float = 3600.0,
        trusted_keys: TrustedKeysOption = None,
        signing_key: Any = None,
        remote: str | RemoteTier | None = None,
        remote_options: Mapping[str, Any] | None = None,
        remote_timeout: float | None = None,
    ) -> None:
        self.root = resolve_root(root)
        self.size_limit = _size_limit_from_env() if size_limit is None else size_limit
        if isinstance(self.size_limit, bool) or not isinstance(self.size_limit, int):
            raise InvalidOptionError(f"size_limit must be an int of bytes, got {size_limit!r}")
        if self.size_limit <= 0:
            raise InvalidOptionError(f"size_limit must be > 0 bytes, got {self.size_limit}")
        self.trust_foreign = trust_foreign
        self.lock_timeout = lock_timeout
        self.trusted_keys = resolve_trusted_keys(trusted_keys)
        self.signing_key = None if signing_key is None else signing.private_key(signing_key)
        self.remote_timeout = deadline.remote_timeout(remote_timeout)
        if os.path.exists(self.root):  # before anything is written into it
            files.check_root(self.root, trust_foreign)
        self._dirs, self.writable = prepare(self.root)
        if not os.path.isdir(self._dirs["entries"]):
            raise CacheRootError(
                f"cache root {self.root} has no {LAYOUT} layout and cannot be created here"
            )
        files.check_root(self.root, trust_foreign)
        for role in ("base", "entries", "blobs", "tags"):
            files.check_directory(self._dirs[role], trust_foreign)
        self._counters = Counters(os.path.join(self._dirs["base"], "stats.json"))
        if remote is None:
            remote, env_options = remote_from_env()
            remote_options = env_options if remote_options is None else remote_options
        self.remote = RemoteTier(remote, remote_options) if isinstance(remote, str) else remote
        self._tags = Tags(self._dirs["tags"], trust_foreign)

    def __repr__(self) -> str:
        state = "" if self.writable else ", read-only"
        state += "" if self.remote is None else f", remote={self.remote.url!r}"
        return f"ArtifactCache({self.root!r}, size_limit={self.size_limit}{state})"

    # -- paths and locks -------------------------------------------------------------
    def entry_path(self, key: str) -> str:
        if not _is_digest(key):
            raise InvalidOptionError(f"cache key must be a sha256 hex digest, got {key!r}")
        return os.path.join(self._dirs["entries"], key + ".json")

    def _blob_path(self, digest: str) -> str:
        return os.path.join(self._dirs["blobs"], digest[:2], digest)

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """The exclusive lock ``name`` (a cache key: single flight for that key). Raises
        ``CacheWriteError`` on a read-only cache, filelock's ``Timeout`` after
        ``lock_timeout``. See ``_locks`` for the order locks are taken in."""
        self.entry_path(name)  # a key, nothing else
        with locks.exclusive(self._lock_path(name), self.lock_timeout):
            remote = self.remote
            if remote is None:
                yield
                return
            lease = self._remote_lease(name)
            try:
                yield
            finally:
                if lease is not None:
                    self._remote("lease release", functools.partial(remote.release, lease))

    def _remote_lease(self, key: str) -> Lease | None:
        """Take the key's remote lease for a compile, or wait for the entry another
        machine is compiling (up to ``lock_timeout``, then go on: compiling twice is
        only wasteful). Each try is one remote operation under its deadline; a remote
        that fails or does not answer means no lease, and the compile goes on."""
        remote = self.remote
        assert remote is not None
        waited_until = time.monotonic() + self.lock_timeout
        delay = 0.05

        def release_late(lease: Any) -> None:  # taken after we stopped waiting for it
            if isinstance(lease, Lease):
                remote.release(lease)

        while True:
            lease = self._remote(
                "lease", functools.partial(remote.try_lease, key), on_late=release_late
            )
            if lease is not False:
                return lease if isinstance(lease, Lease) else None
            if time.monotonic() > waited_until:
                log.warning(
                    "waited %.0f s for another machine's compile of %s", self.lock_timeout, key[:12]
                )
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _lock_path(self, name: str) -> str:
        return os.path.join(self._dirs["locks"], name + ".lock")

    def _gc_lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        return locks.shared_or_exclusive(
            self._lock_path("gc"), exclusive=exclusive, timeout=self.lock_timeout
        )

    # -- reading -----------------------------------------------------------------------
    def _read_document(self, key: str, *, quarantine: bool = True) -> dict[str, Any] | None:
        """The entry's document, checked; a corrupt one is quarantined and a miss (None),
        or, with ``quarantine=False``, raises ``CorruptArtifactError`` and stays."""
        path = self.entry_path(key)
        try:
            raw = files.read_checked(path, _MAX_ENTRY_BYTES, self.trust_foreign)
        except FileNotFoundError:
            return None
        try:
            document = decode_json(raw, f"cache entry {key[:12]}")
            self._validate(key, document)
        except PayloadLimitError:
            raise  # the entry may be healthy: a limit set too low loses nothing
        except CorruptArtifactError as exc:
            if not quarantine:
                raise
            self._quarantine(key, str(exc))
            return None
        signature = None
        if "signature" in document:
            signature = Signature.from_json(document["signature"], f"cache entry {key[:12]}")
        where = f"cache entry {key[:12]}"
        if self.trusted_keys is not None:  # else nothing is checked: no digest to compute
            signing.check_signature(_signed_digest(document), signature, self.trusted_keys, where)
        checked: dict[str, Any] = document
        return checked

    @staticmethod
    def _validate(key: str, document: Any) -> None:
        if not isinstance(document, dict) or document.get("key") != key:
            raise CorruptArtifactError("entry does not describe its own key")
        blobs, aux = document.get("blobs"), document.get("aux")
        if not isinstance(blobs, dict) or not isinstance(aux, dict):
            raise CorruptArtifactError("entry lacks its blob table")
        for digest, size in blobs.items():
            if not _is_digest(digest):
                raise CorruptArtifactError(f"entry lists blob {str(digest)[:12]} oddly")
            check_payload_size(size, digest, f"cache entry {key[:12]}")
        for name, digest in aux.items():
            if not isinstance(name, str) or digest not in blobs:
                raise CorruptArtifactError(f"entry's aux {name!r:.40} names no listed blob")
        if not isinstance(document.get("factors", {}), dict):
            raise CorruptArtifactError("entry's factors are not a table")
        if not _is_about(document.get("about", {})):
            raise CorruptArtifactError("entry's about is not a small table of text")

    def _read_blob(
        self, digest: str, raw_size: int, key: str, *, quarantine: bool = True,
        fd: int | None = None,
    ) -> bytes:  # fmt: skip
        """A blob, verified; a bad one is moved to quarantine (``quarantine=False``: it
        stays) and raises ``CorruptArtifactError``. ``fd``: read through this descriptor
        (opened with ``files.open_checked`` when the entry was read), not the path."""
        path = self._blob_path(digest)
        limit = max(raw_size, 1 << 20) * 2 + 4096
        try:
            if fd is None:
                stored = files.read_checked(path, limit, self.trust_foreign)
            else:
                os.lseek(fd, 0, os.SEEK_SET)
                stored = read_fd(fd, limit, path)
            return decompress(stored, raw_size, digest, f"cache blob {digest[:12]}")
        except PayloadLimitError:
            raise  # a limit set below a healthy blob: nothing is damaged
        except CorruptArtifactError:
            # Content-addressed: a bad blob (altered, oversized, not a regular file) must
            # go, or the write refilling its entry would keep it.
            if quarantine:
                self._quarantine_blob(path, digest)
            raise
        except UnsafeCacheError:
            if not os.path.islink(path):
                raise  # another user's file, or one others may write: refused as it is
            if quarantine:
                self._quarantine_blob(path, digest)  # the link moves; nothing is followed
            raise CorruptArtifactError(
                f"cache blob {digest[:12]} is a symbolic link"
                + (" (moved to quarantine)" if quarantine else "")
            ) from None

    def _quarantine_blob(self, path: str, digest: str) -> None:
        target = os.path.join(self._dirs["quarantine"], f"blob-{digest}.{time.time_ns()}")
        with contextlib.suppress(OSError):
            os.replace(path, target)

    def _lazily(self, key: str, document: dict[str, Any], aux: set[str]) -> StoredEntry:
        """``get(lazy=True)``'s entry: its aux blobs read, the others on first use. Each
        of those is opened now and read through its descriptor later: an entry that
        loaded keeps its bytes until it is dropped, though another process evicts them
        (an unlinked file stays readable while open; the descriptors close when the
        entry's blobs are read or garbage collected)."""
        sizes: Mapping[str, int] = document["blobs"]
        pinned: dict[str, int] = {}
        try:
            for digest in sizes:
                if digest in aux:
                    os.lstat(self._blob_path(digest))  # FileNotFoundError: as get's
                else:
                    pinned[digest] = files.open_checked(self._blob_path(digest),
                                                        self.trust_foreign)  # fmt: skip
            read = self._read_blobs({d: sizes[d] for d in aux}, key)
        except BaseException:
            _close_all(pinned)
            raise
        found_corrupt: list[str] = []  # what this entry's earlier reads found
        lock = threading.Lock()

        def read_later(digest: str) -> bytes:
            with lock:
                fd = pinned.pop(digest, None)
            try:
                return self._read_blob(digest, sizes[digest], key, fd=fd)
            except FileNotFoundError:
                if found_corrupt:
                    raise CorruptArtifactError(
                        f"cache entry {key[:12]} was quarantined when a read of it found "
                        f"{found_corrupt[0]}; load it again (a compile refills it)"
                    ) from None
                raise CorruptArtifactError(
                    f"cache blob {digest[:12]} of entry {key[:12]} was removed after the "
                    "entry was read (evicted or deleted): load the entry again"
                ) from None
            except CorruptArtifactError as exc:
                found_corrupt.append(str(exc))
                self._quarantine(key, str(exc))
                raise
            finally:
                if fd is not None:
                    os.close(fd)

        payloads = VerifiedBlobs({d: n for d, n in sizes.items() if d not in aux}, read_later)
        weakref.finalize(payloads, _close_all, pinned)
        with contextlib.suppress(OSError):  # approximate LRU: last use is the entry's mtime
            os.utime(self.entry_path(key))
        self._count("hits")
        return _stored(key, document, read, payloads)

    def _read_blobs(self, sizes: Mapping[str, int], key: str) -> dict[str, bytes]:
        """Every blob of an entry, verified. Several large blobs are read in threads
        (decompression and hashing release the GIL): a GPU model's four variants load
        in the time of the largest, not of all four."""
        if len(sizes) < 2 or sum(sizes.values()) < _PARALLEL_READ_BYTES:
            return {d: self._read_blob(d, size, key) for d, size in sizes.items()}
        with ThreadPoolExecutor(max_workers=min(4, len(sizes))) as pool:
            read = pool.map(lambda item: self._read_blob(item[0], item[1], key), sizes.items())
            return dict(zip(sizes, read, strict=True))

    def get(self, key: str, *, lazy: bool = False, touch: bool = True) -> StoredEntry | None:
        """The entry under ``key`` with every blob verified, or None on a miss (a corrupt
        entry is quarantined first). Raises ``UntrustedArtifactError`` where trusted keys
        are configured and the entry is not signed by one, ``UnsafeCacheError`` where
        another user could have written it.

        ``lazy``: every blob is checked to be there, and read and verified when the
        entry's ``blobs`` are first indexed by it (``VerifiedBlobs``): a serving process
        reads the code it runs, not every variant's fallback. A blob found corrupt then
        raises ``CorruptArtifactError`` (the entry is quarantined); one removed since,
        ``CorruptArtifactError`` too.

        ``touch=False``: a check, not a use: the entry's last use and the hit and miss
        counts stay as they were, and the remote tier is not asked."""
        document = self._read_document(key)
        if document is None:
            fetched = self._fetch(key) if self.remote is not None and touch else None
            if touch:
                self._count("misses" if fetched is None else "hits")
            return fetched
        aux = set(document["aux"].values())
        count = self._count if touch else (lambda field, amount=1: None)
        try:
            if lazy:
                return self._lazily(key, document, aux)
            blobs = self._read_blobs(document["blobs"], key)
        except FileNotFoundError:
            if os.path.exists(self.entry_path(key)):
                self._quarantine(key, "a blob it references is missing")
            count("misses")  # else evicted while we read: a plain miss
            return None
        except CorruptArtifactError as exc:
            self._quarantine(key, str(exc))
            count("misses")
            return None
        if touch:
            with contextlib.suppress(OSError):  # approximate LRU: last use is the mtime
                os.utime(self.entry_path(key))
        count("hits")
        return _stored(key, document, blobs)

    def contains(self, key: str) -> bool:
        return os.path.exists(self.entry_path(key))

    # -- writing -----------------------------------------------------------------------
    def put(
        self,
        key: str,
        document: Any,
        blobs: Mapping[str, bytes],
        factors: Mapping[str, str],
        aux: Mapping[str, bytes] | None = None,
        *,
        about: Mapping[str, str] | None = None,
    ) -> None:
        """Store an entry: ``document`` (any JSON value; an artifact's manifest, say),
        the ``blobs`` it references by sha256, its key ``factors``, named ``aux`` blobs,
        and ``about``: what the entry is, in a few words for people (``cache ls``; not
        part of the key). Atomic: on failure (``CacheWriteError`` for a full or read-only
        disk) nothing of it remains. Evicts least recently used entries past the limit."""
        path = self.entry_path(key)
        if about is not None and not _is_about(dict(about)):
            raise InvalidOptionError(
                f"about must map at most {_ABOUT_ITEMS} names (<= {_ABOUT_NAME} characters) "
                f"to text (<= {_ABOUT_TEXT} characters), got {about!r:.200}"
            )
        for digest, data in blobs.items():
            if sha256_hex(data) != digest:
                raise InvalidOptionError(f"blob {digest[:12]} given to put() is not its sha256")
        aux_digests = {name: sha256_hex(data) for name, data in (aux or {}).items()}
        everything = {**dict(blobs), **{aux_digests[n]: d for n, d in (aux or {}).items()}}
        created: list[str] = []
        try:
            with self._gc_lock(exclusive=False):
                for digest, data in everything.items():
                    if self._write_blob(digest, data):
                        created.append(digest)
                entry: dict[str, Any] = {
                    "key": key,
                    "layout": LAYOUT,
                    "created": time.time(),
                    "factors": dict(factors),
                    "blobs": {d: len(data) for d, data in everything.items()},
                    "aux": aux_digests,
                    "document": document,
                }
                if about:
                    entry["about"] = dict(about)
                if self.signing_key is not None:
                    entry["signature"] = signing.sign_digest(
                        _signed_digest(entry), self.signing_key
                    ).to_json()
                entry_bytes = json.dumps(entry, indent=1, allow_nan=False).encode()
                with atomic_file(path) as handle:
                    handle.write(entry_bytes)
        except OSError as exc:
            for digest in created:  # ours alone: no entry references them yet
                files.remove(self._blob_path(digest))
            if isinstance(exc, CacheWriteError):
                raise
            raise CacheWriteError(
                exc.errno or 0, f"cache {self.root} could not store {key[:12]}: {exc}"
            ) from exc
        log.info("cached %s (%d blobs)", key[:12], len(everything))
        if self.remote is not None:
            self.upload(key)
        try:
            self.prune(keep=key)
        except (OSError, locks.Timeout) as exc:
            log.warning("cache %s: eviction after a write failed: %s", self.root, exc)

    def _write_blob(self, digest: str, raw: bytes) -> bool:
        """Write one blob unless an intact one is there; True if this call created it."""
        path = self._blob_path(digest)
        if os.path.exists(path):
            with contextlib.suppress(OSError):
                os.utime(path)
            return False
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with atomic_file(path) as handle:
            handle.write(compress(raw))
        return True

    def sign(self, key: str, signing_key: Any) -> None:
        """Sign an existing entry in place (its document and blob table, so every blob)."""
        path = self.entry_path(key)
        raw = files.read_checked(path, _MAX_ENTRY_BYTES, self.trust_foreign)
        document = decode_json(raw, f"cache entry {key[:12]}")
        self._validate(key, document)
        document["signature"] = signing.sign_digest(_signed_digest(document), signing_key).to_json()
        used = os.stat(path)
        with self._gc_lock(exclusive=False):
            with atomic_file(path) as handle:
                handle.write(json.dumps(document, indent=1, allow_nan=False).encode())
            with contextlib.suppress(OSError):  # signing is not a use: keep the LRU order
                os.utime(path, ns=(used.st_atime_ns, used.st_mtime_ns))

    # -- the remote tier -------------------------------------------------------------
    def _remote(
        self,
        what: str,
        action: Callable[[], Any],
        default: Any = None,
        *,
        seconds: float | None = None,
        on_late: Callable[[Any], Any] | None = None,
        failures: list[str] | None = None,
    ) -> Any:
        """Run a remote operation under its deadline (``remote_timeout`` unless
        ``seconds`` is given); any failure (network, permissions, throttling, a vanished
        or silent server) is logged and answered with ``default``. It is counted in the
        local stats and logged as a warning, unless ``failures`` is given: a caller that
        takes the failure reports it (a listing, which is read-only, leaves the local
        cache unchanged; the message is said once, by that caller)."""
        limit = self.remote_timeout if seconds is None else seconds
        level = logging.WARNING if failures is None else logging.DEBUG
        try:
            return deadline.call(action, limit, what, on_late)
        except deadline.RemoteTimeout as exc:
            log.log(level, "remote cache %s: %s timed out: %s; going on locally", self.remote,
                    what, exc)  # fmt: skip
            self._remote_failed(f"timed out: {exc}", failures, timed_out=True)
            return default
        except Exception as exc:  # a remote must never fail a call we can serve locally
            log.log(level, "remote cache %s: %s failed: %s: %s", self.remote, what,
                    type(exc).__name__, str(exc)[:200])  # fmt: skip
            self._remote_failed(f"{type(exc).__name__}: {str(exc)[:200]}", failures)
            return default

    def _remote_failed(
        self, reason: str, failures: list[str] | None, timed_out: bool = False
    ) -> None:
        if failures is not None:
            failures.append(reason)
            return
        if timed_out:
            self._count("remote_timeouts")
        self._count("remote_errors")

    def _remote_refusal(self, blobs: Mapping[str, int]) -> str | None:
        """Why an entry is too large to move through the remote, before any request."""
        if len(blobs) > REMOTE_ENTRY_MAX_BLOBS:
            return f"it lists {len(blobs)} blobs, over the {REMOTE_ENTRY_MAX_BLOBS} allowed"
        total = sum(blobs.values())
        limit = min(REMOTE_ENTRY_MAX_BYTES, self.size_limit)
        if total > limit:
            return f"its blobs are {total} bytes, over the {limit} allowed"
        return None

    def _fetch(self, key: str) -> StoredEntry | None:
        """The remote entry under ``key``, verified and copied into the local cache (a
        read-only local cache still serves it, from memory). One deadline for it all:
        ``remote_timeout`` plus the transfer allowance of the blobs it lists."""
        remote = self.remote
        assert remote is not None
        started = time.monotonic()
        raw = self._remote(
            "read entry", lambda: remote.read(remote.entry_path(key), _MAX_ENTRY_BYTES)
        )
        if raw is None:
            self._count("remote_misses")
            return None
        where = f"remote entry {key[:12]}"
        try:
            document = decode_json(raw, where)
            self._validate(key, document)
            signature = None
            if "signature" in document:
                signature = Signature.from_json(document["signature"], where)
            signing.check_signature(_signed_digest(document), signature, self.trusted_keys, where)
        except (CorruptArtifactError, UntrustedArtifactError) as exc:
            log.warning("%s refused: %s", where, exc)
            self._count("remote_errors")
            return None
        refusal = self._remote_refusal(document["blobs"])
        if refusal is not None:
            log.warning("%s refused before any blob was requested: %s", where, refusal)
            self._count("remote_errors")
            return None
        stored: dict[str, bytes] = {}
        raws: dict[str, bytes] = {}
        blobs = list(document["blobs"].items())
        # A stored blob is zstd of the raw bytes: never much larger than them.
        wanted = [(remote.blob_path(digest), size * 2 + 4096) for digest, size in blobs]
        left = self.remote_timeout - (time.monotonic() - started)
        left += deadline.transfer_allowance(sum(size for _, size in blobs))
        datas = self._remote(
            "read blobs", functools.partial(remote.read_many, wanted), seconds=left
        )
        if datas is None or any(data is None for data in datas):
            self._count("remote_misses")
            return None
        for (digest, size), (path, _), data in zip(blobs, wanted, datas, strict=True):
            try:
                raws[digest] = decompress(data, size, digest, f"remote blob {digest[:12]}")
            except CorruptArtifactError as exc:
                if fails_own_digest(data, digest):
                    # Content-addressed: remove it, so the next upload replaces it.
                    log.warning("%s; removing it from the remote", exc)
                    self._remote("remove corrupt blob", functools.partial(remote.remove, path))
                else:  # the entry's word against the blob's own bytes: the entry loses
                    log.warning("%s refused: %s (the blob itself is intact and stays)", where, exc)
                self._count("remote_errors")
                return None
            stored[digest] = data
        self._count("remote_hits")
        log.info("fetched %s from the remote cache %s", key[:12], remote.url)
        if self.writable:
            try:
                with self._gc_lock(exclusive=False):
                    for digest, data in stored.items():
                        self._write_stored_blob(digest, data)
                    with atomic_file(self.entry_path(key)) as handle:
                        handle.write(raw)
            except (OSError, locks.Timeout) as exc:
                log.warning("could not keep remote entry %s locally: %s", key[:12], exc)
        return _stored(key, document, raws)

    def _write_stored_blob(self, digest: str, stored: bytes) -> None:
        path = self._blob_path(digest)
        if os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with atomic_file(path) as handle:
            handle.write(stored)

    def upload(self, key: str) -> bool:
        """Copy a local entry to the remote: blobs first, the entry last. False (logged)
        where the remote failed; the local entry is untouched either way."""
        remote = self.remote
        if remote is None:
            raise InvalidOptionError("this cache has no remote tier")
        raw = files.read_checked(self.entry_path(key), _MAX_ENTRY_BYTES, self.trust_foreign)
        document = decode_json(raw, f"cache entry {key[:12]}")
        self._validate(key, document)
        refusal = self._remote_refusal(document["blobs"])
        if refusal is not None:
            log.warning("entry %s not uploaded: %s (no remote reader would take it)",
                        key[:12], refusal)  # fmt: skip
            return False

        def push() -> bool:
            for digest in document["blobs"]:
                target = remote.blob_path(digest)
                if not remote.exists(target):
                    local = files.read_checked(self._blob_path(digest), 1 << 40, self.trust_foreign)
                    remote.write(target, local)
            remote.write(remote.entry_path(key), raw)
            for name, tagged in self._tags.all().items():  # tags after what they name
                if tagged == key:
                    remote.write(remote.tag_path(name), key.encode())
            return True

        seconds = self.remote_timeout + deadline.transfer_allowance(sum(document["blobs"].values()))
        done = bool(self._remote(f"upload of {key[:12]}", push, default=False, seconds=seconds))
        if done:
            self._count("remote_uploads")
        return done

    def pull(self, keys: Sequence[str]) -> list[str]:
        """Copy remote entries into the local cache (verified), with the remote's tags
        that name them; returns the keys now held locally (absent or bad ones left out,
        and names that are not keys skipped with a warning)."""
        remote = self.remote
        if remote is None:
            raise InvalidOptionError("this cache has no remote tier")
        done = []
        for key in keys:
            if not _is_digest(key):
                log.warning("remote entry %r skipped: not a cache key", key)
            elif self.contains(key) or self._fetch(key) is not None:
                done.append(key)
        if not done:
            return done
        tags: dict[str, str] = self._remote("tag listing", remote.tags, default={})
        for name, tagged in tags.items():
            if tagged in done and self._tags.get(name) != tagged:
                try:
                    self._tags.set(name, tagged)  # validates the name
                except (ValueError, OSError) as exc:
                    log.warning("remote tag %r not taken: %s", name, exc)
        return done

    def remote_scan(self) -> RemoteScan:
        """The remote's entries: the names that are cache keys, and those skipped (a
        name that is not a key is reported, never made into a path)."""
        remote = self.remote
        if remote is None:
            raise InvalidOptionError("this cache has no remote tier")
        failures: list[str] = []
        names: list[str] = self._remote("listing", remote.entries, default=[], failures=failures)
        skipped = [(n, "not a cache key (a sha256 hex digest)") for n in names if not _is_digest(n)]
        for name, reason in skipped:
            log.warning("remote entry %r skipped: %s", name, reason)
        error = failures[0] if failures else None
        return RemoteScan(tuple(n for n in names if _is_digest(n)), tuple(skipped), error)

    def remote_entries(self) -> list[str]:
        """The keys the remote holds (see ``remote_scan`` for the names skipped)."""
        return list(self.remote_scan().keys)

    # -- tags ------------------------------------------------------------------------
    def tag(self, name: str, key: str, *, to_remote: bool = True) -> None:
        """Name an entry, so that a server can load it without tracing its model again
        (the remote tier gets the tag too, unless ``to_remote=False``: a pull names
        locally what the remote named)."""
        self.entry_path(key)  # validates the key
        self._tags.set(name, key)
        remote = self.remote
        if remote is not None and to_remote:
            self._remote("tag", lambda: remote.write(remote.tag_path(name), key.encode()))
        log.info("tagged %s as %r", key[:12], name)

    def tags(self) -> dict[str, str]:
        """Every tag and the key it names (tags of evicted entries included)."""
        return self._tags.all()

    def remote_tagged(self, name: str) -> tuple[str | None, str | None]:
        """The key the remote's own tag ``name`` names (None where it has none), and why
        it could not be read (a read-only query: its failure goes to the caller)."""
        remote = self.remote
        if remote is None:
            raise InvalidOptionError("this cache has no remote tier")
        self._tags._path(name)  # validates the name before it goes into a remote path
        failures: list[str] = []
        read = lambda: remote.read(remote.tag_path(name), 1024)  # noqa: E731
        raw = self._remote("tag", read, failures=failures)
        if failures:
            return None, failures[0]
        key = None if raw is None else raw.decode("ascii", "replace").strip()
        if key is not None and not _is_digest(key):
            return None, f"its tag {name!r} names {key[:80]!r}, which is not a cache key"
        return key, None

    def tagged(self, name: str) -> str | None:
        """The key a tag names (here, else on the remote), or None."""
        key = self._tags.get(name)
        remote = self.remote
        if key is None and remote is not None:
            self._tags._path(name)  # validates the name before it goes into a remote path
            raw = self._remote("tag", lambda: remote.read(remote.tag_path(name), 1024))
            key = None if raw is None else raw.decode("ascii", "replace").strip()
        if key is not None and not _is_digest(key):
            log.warning("tag %r names %r, which is not a cache key; ignoring it", name, key)
            return None
        return key

    # -- maintenance -------------------------------------------------------------------
    def _quarantine(self, key: str, reason: str) -> None:
        source = self.entry_path(key)
        target = os.path.join(self._dirs["quarantine"], f"{key}.{time.time_ns()}.json")
        try:
            os.replace(source, target)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning(
                "cache entry %s is corrupt (%s) and cannot be moved: %s", key[:12], reason, exc
            )
            return
        self._count("corrupt")
        log.warning("cache entry %s is corrupt (%s); moved to %s", key[:12], reason, target)

    def scan(self) -> CacheScan:
        """Every entry (read without its blobs), and what could not be read."""
        found: list[CacheEntry] = []
        unreadable: list[tuple[str, str]] = []
        for name in files.listing(self._dirs["entries"]):
            if not name.endswith(".json") or not _is_digest(name[:-5]):
                continue
            path = os.path.join(self._dirs["entries"], name)
            try:
                raw = files.read_checked(path, _MAX_ENTRY_BYTES, self.trust_foreign)
                document = decode_json(raw, path)
                self._validate(name[:-5], document)
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # evicted while we listed
            except (OSError, CorruptArtifactError) as exc:
                unreadable.append((path, f"{type(exc).__name__}: {exc}"))
                continue
            blobs = dict.fromkeys(document["blobs"], 0)
            for digest in blobs:
                blobs[digest] = files.size_of(self._blob_path(digest))
            found.append(
                CacheEntry(
                    key=name[:-5],
                    size=info.st_size + sum(blobs.values()),
                    created=float(document.get("created", info.st_mtime)),
                    last_used=info.st_mtime,
                    blobs=blobs,
                    factors=dict(document.get("factors", {})),
                    path=path,
                    signed="signature" in document,
                    about=dict(document.get("about", {})),
                )
            )
        return CacheScan(tuple(found), tuple(unreadable))

    def document(self, key: str) -> Any:
        """The document stored under ``key``, read and checked like a listing reads it (no
        blob is read, no signature checked, nothing is run: for looking at, not loading).
        Raises ``FileNotFoundError`` where there is no such entry, ``CorruptArtifactError``
        where it cannot be read."""
        raw = files.read_checked(self.entry_path(key), _MAX_ENTRY_BYTES, self.trust_foreign)
        entry = decode_json(raw, f"cache entry {key[:12]}")
        self._validate(key, entry)
        return entry.get("document")

    def entries(self) -> list[CacheEntry]:
        """Every readable entry (``scan()`` also says what could not be read)."""
        return list(self.scan().entries)

    def _temp_files(self) -> list[str]:
        found = []
        for base, _, names in os.walk(self._dirs["base"]):
            if os.path.basename(base) == "quarantine":
                continue
            found += [os.path.join(base, n) for n in names if n.startswith(".precompile-")]
        return found

    def total_size(self) -> int:
        """Bytes of entries, blobs and temp files (locks and quarantine not counted)."""
        size = 0
        for base, _, names in os.walk(self._dirs["base"]):
            if os.path.basename(base) in ("locks", "quarantine"):
                continue
            size += sum(files.size_of(os.path.join(base, n)) for n in names)
        return size

    def _all_blobs(self) -> dict[str, int]:
        found = {}
        for prefix in files.listing(self._dirs["blobs"]):
            directory = os.path.join(self._dirs["blobs"], prefix)
            for name in files.listing(directory):
                if _is_digest(name):
                    found[name] = files.size_of(os.path.join(directory, name))
        return found

    def prune(
        self, size_limit: int | None = None, *, keep: str | None = None, dry_run: bool = False
    ) -> PrunePlan:
        """Evict least recently used entries until the cache fits ``size_limit``, and drop
        blobs no entry references and temp files of writers that died. ``keep`` is never
        evicted (the entry just written). ``dry_run``: only say what would go."""
        limit = self.size_limit if size_limit is None else size_limit
        with self._gc_lock(exclusive=True):
            scan = self.scan()
            before = self.total_size()
            blob_sizes = self._all_blobs()
            holders: dict[str, int] = {}
            for entry in scan.entries:
                for digest in entry.blobs:
                    holders[digest] = holders.get(digest, 0) + 1
            stale = [
                p
                for p in self._temp_files()
                if (mtime := files.mtime_of(p)) is not None and time.time() - mtime > _TEMP_GRACE_S
            ]
            size = before - sum(files.size_of(p) for p in stale)
            orphans = {d for d in blob_sizes if d not in holders}
            size -= sum(blob_sizes[d] for d in orphans)
            evicted: list[CacheEntry] = []
            for victim in sorted(scan.entries, key=lambda e: e.last_used):
                if size <= limit:
                    break
                if victim.key == keep:
                    continue
                evicted.append(victim)
                size -= files.size_of(victim.path)
                for digest in victim.blobs:
                    holders[digest] -= 1
                    if holders[digest] == 0:
                        orphans.add(digest)
                        size -= blob_sizes.get(digest, 0)
            plan = PrunePlan(
                evicted=tuple(e.key for e in evicted),
                blobs=tuple(sorted(orphans)),
                temp_files=tuple(stale),
                bytes_freed=before - size,
                size_before=before,
                size_limit=limit,
                dry_run=dry_run,
                problems=tuple(f"{path}: {reason}" for path, reason in scan.unreadable),
            )
            if dry_run:
                return plan
            for entry in evicted:
                files.remove(entry.path)
            for digest in orphans:
                files.remove(self._blob_path(digest))
            for path in stale:
                files.remove(path)
        for key in plan.evicted:
            log.info("evicted cache entry %s", key[:12])
        if plan.evicted:
            self._count("evictions", len(plan.evicted))
        return plan

    def verify(self, *, quarantine: bool = False) -> VerifyReport:
        """Read every entry and blob in full and report the corrupt ones; ``quarantine``:
        move them aside too (a later load compiles again), as a load that finds one does.
        Without it nothing in the cache changes. Holds the gc lock shared (where the
        cache is writable), so no eviction races the check."""
        guard: contextlib.AbstractContextManager[None] = (
            self._gc_lock(exclusive=False) if self.writable else contextlib.nullcontext()
        )
        with guard:
            scan = self.scan()
            corrupt: list[str] = []
            unreadable = list(scan.unreadable)
            intact = 0
            for entry in scan.entries:
                try:
                    reason = self._corruption(entry.key)
                except (UntrustedArtifactError, OSError) as exc:
                    unreadable.append((entry.path, f"{type(exc).__name__}: {exc}"))
                    continue
                if reason is None:
                    intact += 1
                    continue
                corrupt.append(entry.key)
                if quarantine and self.writable:  # as a load that found it would
                    self.get(entry.key, touch=False)
                    self._quarantine(entry.key, reason)
        moved = quarantine and self.writable and bool(corrupt)
        checked = len(scan.entries) + len(scan.unreadable)  # every entry file found
        return VerifyReport(checked, tuple(corrupt), tuple(unreadable), moved, intact)

    def _corruption(self, key: str) -> str | None:
        """Why the entry under ``key`` is corrupt (a blob missing or failing its checks),
        or None where it is intact or gone; reads everything, changes nothing."""
        try:
            document = self._read_document(key, quarantine=False)
        except PayloadLimitError:
            raise
        except CorruptArtifactError as exc:
            return str(exc)
        if document is None:
            return None
        try:
            for digest, size in document["blobs"].items():
                self._read_blob(digest, size, key, quarantine=False)
        except FileNotFoundError:
            gone = not os.path.exists(self.entry_path(key))  # evicted since: no verdict
            return None if gone else "a blob it references is missing"
        except CorruptArtifactError as exc:
            return str(exc)
        return None

    def clear(self, *, dry_run: bool = False) -> PrunePlan:
        """Remove every entry and blob (``dry_run``: only say what would go)."""
        return self.prune(0, dry_run=dry_run)

    def explain_miss(self, key: str, factors: Mapping[str, str]) -> MissExplanation:
        """Which key factors differ from the nearest entry (why ``key`` missed)."""
        entries = self.entries()
        if any(e.key == key for e in entries):
            return MissExplanation(key, key, ())
        return self.explain_against(key, factors, entries)

    @staticmethod
    def explain_against(
        key: str, factors: Mapping[str, str], entries: Sequence[CacheEntry]
    ) -> MissExplanation:
        best: tuple[int, str, tuple[str, ...]] | None = None
        for entry in entries:
            names = sorted(set(factors) | set(entry.factors))
            differing = tuple(n for n in names if factors.get(n) != entry.factors.get(n))
            if best is None or len(differing) < best[0]:
                best = (len(differing), entry.key, differing)
        if best is None:
            return MissExplanation(key, None, ())
        nearest = next(e for e in entries if e.key == best[1])
        details = tuple(
            detail
            for name in best[2]
            if (detail := _field_difference(name, factors.get(name), nearest.factors.get(name)))
        )
        return MissExplanation(key, best[1], best[2], details)

    # -- stats -------------------------------------------------------------------------
    def _count(self, field: str, amount: int = 1) -> None:
        """Best effort: a read-only or full cache still serves, uncounted."""
        if not self.writable:
            return
        try:
            with locks.exclusive(self._lock_path("stats"), timeout=5.0):
                self._counters.add(field, amount)
        except (OSError, locks.Timeout) as exc:
            log.debug("cache %s: counting a %s failed: %s", self.root, field, exc)

    def stats(self) -> CacheStats:
        counts = self._counters.read()
        return CacheStats(
            **counts,
            entries=len(self.entries()),
            size=self.total_size(),
            size_limit=self.size_limit,
            writable=self.writable,
        )


def _field_difference(name: str, here: str | None, there: str | None) -> str | None:
    """Where a factor that differs is a JSON object on both sides (the global state:
    grad mode, autocast, default dtype, ...), which of its fields differ and how: "differs
    in: global_state" did not say that the grad mode was what differed."""
    try:
        mine, theirs = json.loads(here or ""), json.loads(there or "")
    except (TypeError, ValueError):
        return None
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return None
    fields = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if not fields:
        return None
    said = "; ".join(
        f"{field} {_short(mine.get(field))} here, {_short(theirs.get(field))} there"
        for field in fields[:4]
    )
    return f"{name}: {said}" + (f" (and {len(fields) - 4} more)" if len(fields) > 4 else "")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _close_all(descriptors: dict[str, int]) -> None:
    """Close the descriptors of an entry's blobs not read (its payloads were dropped)."""
    while descriptors:
        _, fd = descriptors.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)
