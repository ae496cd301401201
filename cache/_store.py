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
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from . import _deadline as deadline
from . import _files as files
from . import _locks as locks
from . import _signing as signing
from ._bytes import (
    atomic_file,
    compress,
    decompress,
    read_fd,
    sha256_hex,
)
from ._counters import Counters
from ._document import (
    ABOUT_ITEMS,
    ABOUT_NAME,
    ABOUT_TEXT,
    MAX_ENTRY_BYTES,
    is_about,
    is_digest,
    signed_digest,
    stored,
    validate,
)
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
from ._remote_store import RemoteStore, open_remote, remote_from_env
from ._root import LAYOUT, prepare, resolve_root
from ._settings import env_bytes
from ._signing import Signature, TrustedKeysOption, resolve_trusted_keys
from ._tags import Tags
from ._tier import RemoteTier

# An entry's blobs are read in threads when they hold at least this many bytes together.
_PARALLEL_READ_BYTES = 8 << 20

log = logging.getLogger("precompile.cache")
DEFAULT_SIZE_LIMIT = 20 * 2**30
_TEMP_GRACE_S = 600.0  # a temp file this old belongs to a writer that died


def _size_limit_from_env() -> int:
    return env_bytes("PRECOMPILE_CACHE_SIZE_LIMIT", DEFAULT_SIZE_LIMIT)


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
    for fsspec (default ``$PRECOMPILE_REMOTE_CACHE_OPTIONS``, JSON), or any
    ``RemoteStore`` object: a local miss is looked up there and copied in, and every
    write is uploaded (``_tier``). ``remote_timeout``: seconds any one remote operation
    may take (default ``$PRECOMPILE_REMOTE_TIMEOUT``, else 5), plus 1 s per 8 MiB it
    transfers; past it the call goes on locally.
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
        remote: str | RemoteStore | None = None,
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
        self.remote: RemoteStore | None = None
        self._tier: RemoteTier | None = None
        if remote is not None:
            self.remote = open_remote(remote, remote_options)
            self._tier = RemoteTier(self.remote, self)
        self._tags = Tags(self._dirs["tags"], trust_foreign)

    def __repr__(self) -> str:
        state = "" if self.writable else ", read-only"
        state += "" if self.remote is None else f", remote={str(self.remote)!r}"
        return f"ArtifactCache({self.root!r}, size_limit={self.size_limit}{state})"

    # -- paths and locks -------------------------------------------------------------
    def entry_path(self, key: str) -> str:
        if not is_digest(key):
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
            tier = self._tier
            if tier is None:
                yield
                return
            lease = tier.take_lease(name)  # single flight across machines
            try:
                yield
            finally:
                if lease is not None:
                    tier.release(lease)

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
            raw = files.read_checked(path, MAX_ENTRY_BYTES, self.trust_foreign)
        except FileNotFoundError:
            return None
        try:
            document = decode_json(raw, f"cache entry {key[:12]}")
            validate(key, document)
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
            signing.check_signature(signed_digest(document), signature, self.trusted_keys, where)
        checked: dict[str, Any] = document
        return checked

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
                + (" (moved to quarantine)" if quarantine else ""),
                path=path,
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
        return stored(key, document, read, payloads)

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
            fetched = self._tier.fetch(key) if self._tier is not None and touch else None
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
        return stored(key, document, blobs)

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
        if about is not None and not is_about(dict(about)):
            raise InvalidOptionError(
                f"about must map at most {ABOUT_ITEMS} names (<= {ABOUT_NAME} characters) "
                f"to text (<= {ABOUT_TEXT} characters), got {about!r:.200}"
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
                        signed_digest(entry), self.signing_key
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
        if self._tier is not None:
            self._tier.upload(key)
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
        raw = files.read_checked(path, MAX_ENTRY_BYTES, self.trust_foreign)
        document = decode_json(raw, f"cache entry {key[:12]}")
        validate(key, document)
        document["signature"] = signing.sign_digest(signed_digest(document), signing_key).to_json()
        used = os.stat(path)
        with self._gc_lock(exclusive=False):
            with atomic_file(path) as handle:
                handle.write(json.dumps(document, indent=1, allow_nan=False).encode())
            with contextlib.suppress(OSError):  # signing is not a use: keep the LRU order
                os.utime(path, ns=(used.st_atime_ns, used.st_mtime_ns))

    def _write_stored_blob(self, digest: str, stored: bytes) -> None:
        """Keep a blob as another store held it (compressed, verified by the caller)."""
        path = self._blob_path(digest)
        if os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with atomic_file(path) as handle:
            handle.write(stored)

    # -- the remote tier (``_tier``) ---------------------------------------------------
    def _remote_tier(self) -> RemoteTier:
        tier = self._tier
        if tier is None:
            raise InvalidOptionError("this cache has no remote tier")
        return tier

    def upload(self, key: str) -> bool:
        """Copy a local entry to the remote: blobs first, the entry last. False (logged)
        where the remote failed; the local entry is untouched either way."""
        return self._remote_tier().upload(key)

    def pull(self, keys: Sequence[str]) -> list[str]:
        """Copy remote entries into the local cache (verified), with the remote's tags
        that name them; returns the keys now held locally (absent or bad ones left out,
        and names that are not keys skipped with a warning)."""
        return self._remote_tier().pull(keys)

    def remote_scan(self) -> RemoteScan:
        """The remote's entries: the names that are cache keys, and those skipped (a
        name that is not a key is reported, never made into a path)."""
        return self._remote_tier().scan()

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
        if self._tier is not None and to_remote:
            self._tier.tag(name, key)
        log.info("tagged %s as %r", key[:12], name)

    def tags(self) -> dict[str, str]:
        """Every tag and the key it names (tags of evicted entries included)."""
        return self._tags.all()

    def remote_tagged(self, name: str) -> tuple[str | None, str | None]:
        """The key the remote's own tag ``name`` names (None where it has none), and why
        it could not be read (a read-only query: its failure goes to the caller)."""
        tier = self._remote_tier()
        self._tags._path(name)  # validates the name before it goes into a remote path
        failures: list[str] = []
        key = tier.tagged(name, failures)
        if failures:
            return None, failures[0]
        if key is not None and not is_digest(key):
            return None, f"its tag {name!r} names {key[:80]!r}, which is not a cache key"
        return key, None

    def tagged(self, name: str) -> str | None:
        """The key a tag names (here, else on the remote), or None where no tag has the
        name; ``CorruptArtifactError`` for a tag whose file holds no cache key."""
        key = self._tags.get(name)
        if key is None and self._tier is not None:
            self._tags._path(name)  # validates the name before it goes into a remote path
            key = self._tier.tagged(name)
        if key is not None and not is_digest(key):
            shown = key if len(key) <= 80 and key.isprintable() else f"{len(key)} characters"
            raise CorruptArtifactError(
                f"tag {name!r} in {self.root} holds {shown!r}, which is not a cache key (a "
                "sha256 hex digest): the tag is damaged; tag the entry again"
            )
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
            if not name.endswith(".json"):
                continue  # a writer's temp file, say
            path = os.path.join(self._dirs["entries"], name)
            if not is_digest(name[:-5]):  # put there by hand: said, never read
                unreadable.append((path, "its name is not a cache key (a sha256 hex digest)"))
                continue
            try:
                raw = files.read_checked(path, MAX_ENTRY_BYTES, self.trust_foreign)
                document = decode_json(raw, path)
                validate(name[:-5], document)
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
        raw = files.read_checked(self.entry_path(key), MAX_ENTRY_BYTES, self.trust_foreign)
        entry = decode_json(raw, f"cache entry {key[:12]}")
        validate(key, entry)
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
                if is_digest(name):
                    found[name] = files.size_of(os.path.join(directory, name))
        return found

    def prune(
        self, size_limit: int | None = None, *, keep: str | None = None, dry_run: bool = False
    ) -> PrunePlan:
        """Evict least recently used entries until the cache fits ``size_limit``, and drop
        blobs no entry references and temp files of writers that died. ``keep`` is never
        evicted (the entry just written). ``dry_run``: only say what would go (on a
        read-only cache too, which no writer can change under the plan: no lock)."""
        limit = self.size_limit if size_limit is None else size_limit
        planning_only = dry_run and not self.writable
        with contextlib.nullcontext() if planning_only else self._gc_lock(exclusive=True):
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
