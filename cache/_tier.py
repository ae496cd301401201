"""The remote tier: a ``RemoteStore`` behind the local ``ArtifactCache``, so a fleet
compiles each artifact once.

A local miss is looked up in the store and copied in; every write is uploaded (blobs
first, the entry last, tags after what they name); a compile takes the key's lease
(``_lease``). Nothing read from the store is trusted: an entry is validated like a
local one (and its signature checked where trusted keys are configured), an entry that
asks too much is refused before any blob is requested, each blob is checked against its
sha256 and size before it is written into the local cache, and reads are bounded. A
store that fails (network, permissions, throttling) never fails a call that can be
served or compiled locally: every operation runs under its deadline (``_deadline``),
and every failure is logged, counted, and treated as a miss.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from . import _deadline as deadline
from . import _files as files
from . import _locks as locks
from . import _signing as signing
from ._bytes import atomic_file, decompress, fails_own_digest
from ._document import MAX_ENTRY_BYTES, is_digest, signed_digest, stored, validate
from ._entry import RemoteScan, StoredEntry
from ._errors import CorruptArtifactError, UntrustedArtifactError
from ._json import decode_json
from ._lease import Lease, release, try_lease
from ._remote_layout import ENTRIES, TAGS, blob_name, entry_name, tag_name
from ._remote_store import RemoteStore
from ._signing import Signature
from ._tags import Tags

log = logging.getLogger("precompile.cache")
# What one remote entry may ask for, checked before any of its blobs is requested: each
# blob is one request, and all of them are held in memory until verified. Real entries
# list tens of blobs (variants and kernel binaries) and megabytes.
REMOTE_ENTRY_MAX_BLOBS = 1024
REMOTE_ENTRY_MAX_BYTES = 4 << 30
_MAX_TAG_BYTES = 1024


class LocalStore(Protocol):
    """What the tier uses of the local store (``ArtifactCache``): its settings, where its
    files are, its counts, its gc lock and its tags."""

    @property
    def remote_timeout(self) -> float: ...
    @property
    def lock_timeout(self) -> float: ...
    @property
    def size_limit(self) -> int: ...
    @property
    def trusted_keys(self) -> tuple[bytes, ...] | None: ...
    @property
    def trust_foreign(self) -> bool: ...
    @property
    def writable(self) -> bool: ...
    @property
    def _tags(self) -> Tags: ...
    def entry_path(self, key: str) -> str: ...
    def contains(self, key: str) -> bool: ...
    def tags(self) -> dict[str, str]: ...
    def _blob_path(self, digest: str) -> str: ...
    def _count(self, field: str, amount: int = 1) -> None: ...
    def _gc_lock(self, *, exclusive: bool) -> AbstractContextManager[None]: ...
    def _write_stored_blob(self, digest: str, stored: bytes) -> None: ...


class RemoteTier:
    """``store`` behind the local cache ``local``: the fetches, uploads, tags and leases
    of one ``ArtifactCache``, each under its deadline (``local.remote_timeout``)."""

    def __init__(self, store: RemoteStore, local: LocalStore) -> None:
        self.store = store
        self._local = local
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def __repr__(self) -> str:
        return f"RemoteTier({self.store!r})"

    # -- every operation: under its deadline, a failure a miss -------------------------
    def call(
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
        limit = self._local.remote_timeout if seconds is None else seconds
        level = logging.WARNING if failures is None else logging.DEBUG
        try:
            return deadline.call(action, limit, what, on_late)
        except deadline.RemoteTimeout as exc:
            log.log(level, "remote cache %s: %s timed out: %s; going on locally", self.store,
                    what, exc)  # fmt: skip
            self._failed(f"timed out: {exc}", failures, timed_out=True)
            return default
        except Exception as exc:  # a remote must never fail a call we can serve locally
            log.log(level, "remote cache %s: %s failed: %s: %s", self.store, what,
                    type(exc).__name__, str(exc)[:200])  # fmt: skip
            self._failed(f"{type(exc).__name__}: {str(exc)[:200]}", failures)
            return default

    def _failed(self, reason: str, failures: list[str] | None, timed_out: bool = False) -> None:
        if failures is not None:
            failures.append(reason)
            return
        if timed_out:
            self._local._count("remote_timeouts")
        self._local._count("remote_errors")

    def _get(self, wanted: Sequence[tuple[str, int]]) -> list[bytes | None]:
        """``store.get``, each object held to its limit whatever the store read."""
        found = list(self.store.get(wanted))
        if len(found) != len(wanted):
            raise ValueError(f"the store answered {len(found)} objects for {len(wanted)}")
        for (name, limit), data in zip(wanted, found, strict=True):
            if data is not None and not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"the store answered {type(data).__name__} for {name}, not bytes")
            if data is not None and len(data) > limit:
                raise ValueError(f"remote object {name} is over {limit} bytes")
        return [None if data is None else bytes(data) for data in found]

    # -- reading -----------------------------------------------------------------------
    def _refusal(self, blobs: Mapping[str, int]) -> str | None:
        """Why an entry is too large to move through the remote, before any request."""
        if len(blobs) > REMOTE_ENTRY_MAX_BLOBS:
            return f"it lists {len(blobs)} blobs, over the {REMOTE_ENTRY_MAX_BLOBS} allowed"
        total = sum(blobs.values())
        limit = min(REMOTE_ENTRY_MAX_BYTES, self._local.size_limit)
        if total > limit:
            return f"its blobs are {total} bytes, over the {limit} allowed"
        return None

    def fetch(self, key: str) -> StoredEntry | None:
        """The remote entry under ``key``, verified and copied into the local cache (a
        read-only local cache still serves it, from memory). One deadline for it all:
        ``remote_timeout`` plus the transfer allowance of the blobs it lists."""
        local = self._local
        started = time.monotonic()
        found = self.call("read entry", lambda: self._get([(entry_name(key), MAX_ENTRY_BYTES)]))
        raw = None if found is None else found[0]
        if raw is None:
            local._count("remote_misses")
            return None
        where = f"remote entry {key[:12]}"
        try:
            document = decode_json(raw, where)
            validate(key, document)
            signature = None
            if "signature" in document:
                signature = Signature.from_json(document["signature"], where)
            signing.check_signature(signed_digest(document), signature, local.trusted_keys, where)
        except (CorruptArtifactError, UntrustedArtifactError) as exc:
            log.warning("%s refused: %s", where, exc)
            local._count("remote_errors")
            return None
        refusal = self._refusal(document["blobs"])
        if refusal is not None:
            log.warning("%s refused before any blob was requested: %s", where, refusal)
            local._count("remote_errors")
            return None
        kept: dict[str, bytes] = {}
        raws: dict[str, bytes] = {}
        blobs = list(document["blobs"].items())
        # A stored blob is zstd of the raw bytes: never much larger than them.
        wanted = [(blob_name(digest), size * 2 + 4096) for digest, size in blobs]
        left = local.remote_timeout - (time.monotonic() - started)
        left += deadline.transfer_allowance(sum(size for _, size in blobs))
        datas = self.call("read blobs", functools.partial(self._get, wanted), seconds=left)
        if datas is None or any(data is None for data in datas):
            local._count("remote_misses")
            return None
        for (digest, size), (name, _), data in zip(blobs, wanted, datas, strict=True):
            try:
                raws[digest] = decompress(data, size, digest, f"remote blob {digest[:12]}")
            except CorruptArtifactError as exc:
                if fails_own_digest(data, digest):
                    # Content-addressed: remove it, so the next upload replaces it.
                    log.warning("%s; removing it from the remote", exc)
                    self.call("remove corrupt blob", functools.partial(self.store.delete, name))
                else:  # the entry's word against the blob's own bytes: the entry loses
                    log.warning("%s refused: %s (the blob itself is intact and stays)", where, exc)
                local._count("remote_errors")
                return None
            kept[digest] = data
        local._count("remote_hits")
        log.info("fetched %s from the remote cache %s", key[:12], self.store)
        if local.writable:
            try:
                with local._gc_lock(exclusive=False):
                    for digest, data in kept.items():
                        local._write_stored_blob(digest, data)
                    with atomic_file(local.entry_path(key)) as handle:
                        handle.write(raw)
            except (OSError, locks.Timeout) as exc:
                log.warning("could not keep remote entry %s locally: %s", key[:12], exc)
        return stored(key, document, raws)

    # -- writing -----------------------------------------------------------------------
    def upload(self, key: str) -> bool:
        """Copy a local entry to the remote: blobs first, the entry last. False (logged)
        where the remote failed; the local entry is untouched either way."""
        local, store = self._local, self.store
        raw = files.read_checked(local.entry_path(key), MAX_ENTRY_BYTES, local.trust_foreign)
        document = decode_json(raw, f"cache entry {key[:12]}")
        validate(key, document)
        refusal = self._refusal(document["blobs"])
        if refusal is not None:
            log.warning("entry %s not uploaded: %s (no remote reader would take it)",
                        key[:12], refusal)  # fmt: skip
            return False

        def push() -> bool:
            for digest in document["blobs"]:
                if not store.exists(blob_name(digest)):
                    path = local._blob_path(digest)
                    blob = files.read_checked(path, 1 << 40, local.trust_foreign)
                    store.put(blob_name(digest), blob)
            store.put(entry_name(key), raw)
            for name, tagged in local.tags().items():  # tags after what they name
                if tagged == key:
                    store.put(tag_name(name), key.encode())
            return True

        total = sum(document["blobs"].values())
        seconds = local.remote_timeout + deadline.transfer_allowance(total)
        done = bool(self.call(f"upload of {key[:12]}", push, default=False, seconds=seconds))
        if done:
            local._count("remote_uploads")
        return done

    def pull(self, keys: Sequence[str]) -> list[str]:
        """Copy remote entries into the local cache (verified), with the remote's tags
        that name them; returns the keys now held locally."""
        local = self._local
        done = []
        for key in keys:
            if not is_digest(key):
                log.warning("remote entry %r skipped: not a cache key", key)
            elif local.contains(key) or self.fetch(key) is not None:
                done.append(key)
        if not done:
            return done
        tags: dict[str, str] = self.call("tag listing", self._tags, default={})
        for name, tagged in tags.items():
            if tagged in done and local._tags.get(name) != tagged:
                try:
                    local._tags.set(name, tagged)  # validates the name
                except (ValueError, OSError) as exc:
                    log.warning("remote tag %r not taken: %s", name, exc)
        return done

    # -- listings and tags -------------------------------------------------------------
    def scan(self) -> RemoteScan:
        """The remote's entries: the names that are cache keys, and those skipped (a
        name that is not a key is reported, never made into a path)."""
        failures: list[str] = []
        names: list[str] = self.call("listing", self._entries, default=[], failures=failures)
        skipped = [(n, "not a cache key (a sha256 hex digest)") for n in names if not is_digest(n)]
        for name, reason in skipped:
            log.warning("remote entry %r skipped: %s", name, reason)
        error = failures[0] if failures else None
        return RemoteScan(tuple(n for n in names if is_digest(n)), tuple(skipped), error)

    def _entries(self) -> list[str]:
        """The name of every ``.json`` object in ``entries/``, without the suffix:
        whatever the remote holds, keys or not (the caller checks each name)."""
        return sorted(n[:-5] for n in self.store.names(ENTRIES) if n.endswith(".json"))

    def _tags(self) -> dict[str, str]:
        """Every tag the remote holds and the text it names (checked by the caller), all
        read in one call."""
        try:
            names = self.store.names(TAGS)
        except FileNotFoundError:
            return {}
        datas = self._get([(tag_name(name), _MAX_TAG_BYTES) for name in names])
        return {
            name: raw.decode("ascii", "replace").strip()
            for name, raw in zip(names, datas, strict=True)
            if raw is not None
        }

    def tag(self, name: str, key: str) -> None:
        self.call("tag", lambda: self.store.put(tag_name(name), key.encode()))

    def tagged(self, name: str, failures: list[str] | None = None) -> str | None:
        """The text the remote's tag ``name`` holds (not yet checked to be a key), None
        where it has none or the read failed (said in ``failures`` where given)."""
        read = lambda: self._get([(tag_name(name), _MAX_TAG_BYTES)])[0]  # noqa: E731
        raw = self.call("tag", read, failures=failures)
        return None if raw is None else str(raw.decode("ascii", "replace").strip())

    # -- single flight across machines -------------------------------------------------
    def take_lease(self, key: str) -> Lease | None:
        """Take the key's remote lease for a compile, or wait for the entry another
        machine is compiling (up to ``lock_timeout``, then go on: compiling twice is
        only wasteful). Each try is one remote operation under its deadline; a remote
        that fails or does not answer means no lease, and the compile goes on."""
        store, timeout = self.store, self._local.lock_timeout
        waited_until = time.monotonic() + timeout
        delay = 0.05

        def release_late(lease: Any) -> None:  # taken after we stopped waiting for it
            if isinstance(lease, Lease):
                release(store, lease)

        while True:
            lease = self.call(
                "lease", functools.partial(try_lease, store, key, self.owner), on_late=release_late
            )
            if lease is not False:
                return lease if isinstance(lease, Lease) else None
            if time.monotonic() > waited_until:
                log.warning("waited %.0f s for another machine's compile of %s", timeout, key[:12])
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def release(self, lease: Lease) -> None:
        self.call("lease release", functools.partial(release, self.store, lease))
