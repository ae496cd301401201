"""ArtifactCache: content-addressed artifacts on disk, shared safely between processes.

    <root>/CACHEDIR.TAG
    <root>/v1/entries/<key>.json     manifest, factors, payload digests (written last)
    <root>/v1/blobs/<d[:2]>/<d>      zstd-compressed payloads named by sha256 of the raw bytes
    <root>/v1/locks/<key>.lock       single-flight locks (flock: released if the holder dies)
    <root>/v1/quarantine/            entries that failed verification, moved aside

Writes are atomic (temp file in the same dir, ``os.replace``) and ordered blobs first,
entry last, so a process killed mid-save leaves at most unreferenced blobs, which
``prune`` collects. Every read checks digests; a corrupt entry is quarantined and
reported as a miss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import zstandard
from filelock import FileLock

from runtime import CompiledArtifact
from runtime._errors import CorruptArtifactError, InvalidOptionError, UnsafeCacheError
from runtime._manifest import Manifest
from runtime._payloads import MemoryPayloads, atomic_file, sha256_hex

from ._counters import Counters
from ._entry import CacheEntry, CacheStats, MissExplanation, VerifyReport
from ._root import LAYOUT, prepare, resolve_root
from ._tags import Tags

log = logging.getLogger("precompile.cache")
DEFAULT_SIZE_LIMIT = 20 * 2**30
_ORPHAN_GRACE_S = 3600.0


def _size_limit_from_env() -> int:
    text = os.environ.get("PRECOMPILE_CACHE_SIZE_LIMIT")
    if not text:
        return DEFAULT_SIZE_LIMIT
    try:
        value = int(text)
    except ValueError:
        raise InvalidOptionError(
            f"PRECOMPILE_CACHE_SIZE_LIMIT must be a number of bytes, got {text!r}"
        ) from None
    if value <= 0:
        raise InvalidOptionError(f"PRECOMPILE_CACHE_SIZE_LIMIT must be > 0, got {value}")
    return value


class ArtifactCache:
    """A directory of compiled artifacts keyed by everything that changes their code."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        size_limit: int | None = None,
        trust_foreign: bool = False,
        lock_timeout: float = 3600.0,
    ) -> None:
        self.root = resolve_root(root)
        self.size_limit = _size_limit_from_env() if size_limit is None else size_limit
        if self.size_limit <= 0:
            raise InvalidOptionError(f"size_limit must be > 0 bytes, got {self.size_limit}")
        self.trust_foreign = trust_foreign
        self.lock_timeout = lock_timeout
        self._dirs = prepare(self.root)
        self._counters = Counters(os.path.join(self._dirs["base"], "stats.json"))
        self._tags = Tags(self._dirs["tags"])

    def __repr__(self) -> str:
        return f"ArtifactCache({self.root!r}, size_limit={self.size_limit})"

    # -- paths -----------------------------------------------------------------------
    def _entry_path(self, key: str) -> str:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise InvalidOptionError(f"cache key must be a sha256 hex digest, got {key!r}")
        return os.path.join(self._dirs["entries"], key + ".json")

    def _blob_path(self, digest: str) -> str:
        return os.path.join(self._dirs["blobs"], digest[:2], digest)

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        with FileLock(os.path.join(self._dirs["locks"], name + ".lock"), timeout=self.lock_timeout):
            yield

    # -- reading -----------------------------------------------------------------------
    def _check_owner(self, path: str) -> None:
        if self.trust_foreign:
            return
        info = os.stat(path)
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise UnsafeCacheError(
                f"{path} is owned by uid {info.st_uid} or writable by group/others "
                f"(mode {oct(info.st_mode & 0o777)}); loading it would run code another user "
                "could have written. Fix its ownership, or pass trust_foreign=True"
            )

    def _read_entry(self, key: str) -> dict[str, Any] | None:
        path = self._entry_path(key)
        try:
            self._check_owner(path)
            with open(path, "rb") as handle:
                document = json.loads(handle.read())
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as exc:
            self._quarantine(key, f"unreadable entry ({exc})")
            return None
        if not isinstance(document, dict) or document.get("key") != key:
            self._quarantine(key, "entry does not describe its own key")
            return None
        return document

    def _read_blob(self, digest: str) -> bytes:
        path = self._blob_path(digest)
        self._check_owner(path)
        with open(path, "rb") as handle:
            stored = handle.read()
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored)
            problem = None if sha256_hex(raw) == digest else "does not match its sha256"
        except zstandard.ZstdError as exc:
            problem = str(exc)
        if problem is not None:
            # Blobs are content-addressed: a bad one must go, or a refill would keep it.
            target = os.path.join(self._dirs["quarantine"], f"blob-{digest}.{time.time_ns()}")
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, target)
            raise CorruptArtifactError(f"blob {digest[:12]} {problem}")
        return bytes(raw)

    def get(self, key: str) -> tuple[CompiledArtifact, dict[str, bytes]] | None:
        """The artifact (and its auxiliary blobs) under ``key``, or None on a miss."""
        document = self._read_entry(key)
        if document is None:
            self._count("misses")
            return None
        try:
            manifest = Manifest.from_json(document["manifest"])
            payloads = {d: self._read_blob(d) for d in manifest.payload_digests}
            aux = {name: self._read_blob(d) for name, d in document.get("aux", {}).items()}
        except (CorruptArtifactError, KeyError, TypeError, FileNotFoundError) as exc:
            self._quarantine(key, str(exc))
            self._count("misses")
            return None
        os.utime(self._entry_path(key))  # approximate LRU: last use is the entry's mtime
        self._count("hits")
        artifact = CompiledArtifact(manifest, MemoryPayloads(payloads))
        artifact.cache_key = key
        return artifact, aux

    # -- writing -----------------------------------------------------------------------
    def _write_blob(self, raw: bytes) -> str:
        digest = sha256_hex(raw)
        path = self._blob_path(digest)
        if os.path.exists(path):
            os.utime(path)
            return digest
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with atomic_file(path) as handle:
            handle.write(zstandard.ZstdCompressor(level=3).compress(raw))
        return digest

    def put(
        self,
        key: str,
        artifact: CompiledArtifact,
        factors: Mapping[str, str],
        aux: Mapping[str, bytes] | None = None,
    ) -> None:
        manifest = artifact.manifest
        artifact.cache_key = key
        for digest in manifest.payload_digests:
            self._write_blob(artifact.payload_bytes(digest))
        aux_digests = {name: self._write_blob(data) for name, data in (aux or {}).items()}
        document = {
            "key": key,
            "layout": LAYOUT,
            "created": time.time(),
            "factors": dict(factors),
            "aux": aux_digests,
            "manifest": manifest.to_json(),
        }
        with atomic_file(self._entry_path(key)) as handle:
            handle.write(json.dumps(document, indent=1).encode())
        log.info("cached %s (%d variants)", key[:12], len(manifest.variants))
        self.prune(keep=key)

    def get_or_create(
        self,
        key: str,
        factors: Mapping[str, str],
        create: Callable[[], tuple[CompiledArtifact, Mapping[str, bytes]]],
    ) -> tuple[CompiledArtifact, dict[str, bytes], bool]:
        """Single flight: of several processes missing ``key`` together, one creates it
        and the rest wait for its lock, then load what it wrote. Returns (art, aux, hit)."""
        found = self.get(key)
        if found is not None:
            return (*found, True)
        with self.lock(key):
            found = self._get_quiet(key)
            if found is not None:
                return (*found, True)
            artifact, aux = create()
            self.put(key, artifact, factors, aux)
            return artifact, dict(aux), False

    # -- tags ------------------------------------------------------------------------
    def tag(self, name: str, key: str) -> None:
        """Name an entry, so that a server can load it without tracing its model again."""
        self._entry_path(key)  # validates the key
        self._tags.set(name, key)
        log.info("tagged %s as %r", key[:12], name)

    def tags(self) -> dict[str, str]:
        """Every tag and the key it names (tags of evicted entries included)."""
        return self._tags.all()

    def load_tag(self, name: str) -> CompiledArtifact | None:
        """The artifact tagged ``name``, or None if the tag or its entry is gone."""
        key = self._tags.get(name)
        if key is None:
            return None
        try:
            found = self.get(key)
        except InvalidOptionError:
            log.warning("tag %r names %r, which is not a cache key; ignoring it", name, key)
            return None
        return None if found is None else found[0]

    def _get_quiet(self, key: str) -> tuple[CompiledArtifact, dict[str, bytes]] | None:
        if not os.path.exists(self._entry_path(key)):
            return None
        return self.get(key)

    # -- maintenance -------------------------------------------------------------------
    def _quarantine(self, key: str, reason: str) -> None:
        source = self._entry_path(key)
        target = os.path.join(self._dirs["quarantine"], f"{key}.{int(time.time() * 1e6)}.json")
        try:
            os.replace(source, target)
        except FileNotFoundError:
            return
        self._count("corrupt")
        log.warning("cache entry %s is corrupt (%s); moved to %s", key[:12], reason, target)

    def entries(self) -> list[CacheEntry]:
        found = []
        for name in sorted(os.listdir(self._dirs["entries"])):
            if not name.endswith(".json"):
                continue
            path = os.path.join(self._dirs["entries"], name)
            try:
                info = os.stat(path)
                with open(path, "rb") as handle:
                    document = json.loads(handle.read())
                manifest = document["manifest"]
                graphs = [v["payload"] for v in manifest["variants"]]
                kernels = [k["binary"] for v in manifest["variants"] for k in v.get("kernels", [])]
                blobs = tuple(dict.fromkeys((*graphs, *kernels, *document.get("aux", {}).values())))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            size = info.st_size + sum(self._blob_size(d) for d in blobs)
            found.append(
                CacheEntry(
                    key=name[:-5],
                    size=size,
                    created=float(document.get("created", info.st_mtime)),
                    last_used=info.st_mtime,
                    variants=len(manifest["variants"]),
                    payloads=tuple(blobs),
                    factors=dict(document.get("factors", {})),
                    path=path,
                )
            )
        return found

    def _blob_size(self, digest: str) -> int:
        try:
            return os.stat(self._blob_path(digest)).st_size
        except OSError:
            return 0

    def total_size(self) -> int:
        size = 0
        for base, _, files in os.walk(self._dirs["base"]):
            if os.path.basename(base) in ("locks", "quarantine"):
                continue
            size += sum(os.stat(os.path.join(base, f)).st_size for f in files)
        return size

    def prune(self, size_limit: int | None = None, *, keep: str | None = None) -> list[str]:
        """Evict least recently used entries until under the limit; drop orphan blobs.

        ``keep`` (the entry a caller holds the lock of, having just written it) is never
        evicted here."""
        limit = self.size_limit if size_limit is None else size_limit
        evicted: list[str] = []
        with self.lock("gc"):
            everything = self.entries()
            kept = [e for e in everything if e.key == keep]
            entries = sorted((e for e in everything if e.key != keep), key=lambda e: e.last_used)
            total = self.total_size()
            while entries and total > limit:
                victim = entries.pop(0)
                with self.lock(victim.key):
                    try:
                        os.unlink(victim.path)
                    except FileNotFoundError:
                        continue
                total -= victim.size
                evicted.append(victim.key)
            survivors = [*entries, *kept]
            self._drop_orphan_blobs({d for e in survivors for d in e.payloads}, bool(evicted))
        for key in evicted:
            log.info("evicted cache entry %s", key[:12])
        if evicted:
            self._count("evictions", len(evicted))
        return evicted

    def _drop_orphan_blobs(self, referenced: set[str], evicted: bool) -> None:
        cutoff = time.time() - (0.0 if evicted else _ORPHAN_GRACE_S)
        for base, _, files in os.walk(self._dirs["blobs"]):
            for name in files:
                path = os.path.join(base, name)
                if name in referenced or name.startswith("."):
                    continue
                try:
                    if evicted or os.stat(path).st_mtime < cutoff:
                        os.unlink(path)
                except FileNotFoundError:
                    pass

    def verify(self) -> VerifyReport:
        corrupt = []
        entries = self.entries()
        for entry in entries:
            with self.lock(entry.key):
                if self.get(entry.key) is None:
                    corrupt.append(entry.key)
        return VerifyReport(len(entries), tuple(corrupt))

    def clear(self) -> int:
        with self.lock("gc"):
            entries = self.entries()
            for entry in entries:
                with self.lock(entry.key):
                    os.unlink(entry.path)
            self._drop_orphan_blobs(set(), True)
        return len(entries)

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
        return MissExplanation(key, best[1], best[2])

    # -- stats -------------------------------------------------------------------------
    def _count(self, field: str, amount: int = 1) -> None:
        with self.lock("stats"):
            self._counters.add(field, amount)

    def stats(self) -> CacheStats:
        counts = self._counters.read()
        entries = self.entries()
        return CacheStats(
            **counts,
            entries=len(entries),
            size=self.total_size(),
            size_limit=self.size_limit,
        )
