"""What the cache returns: frozen records of entries, scans, stats, plans and checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class StoredEntry:
    """One entry as read back: the document the writer stored (opaque to the cache),
    and every blob it references, each verified against its sha256 and size."""

    key: str
    document: Any  # the JSON value given to ``put`` (an artifact's manifest, say)
    blobs: Mapping[str, bytes]
    aux: Mapping[str, bytes]
    factors: Mapping[str, str]

    def __post_init__(self) -> None:
        for name in ("blobs", "aux", "factors"):
            value = getattr(self, name)
            if not isinstance(value, VerifiedBlobs):  # read-only already, and read lazily
                object.__setattr__(self, name, MappingProxyType(dict(value)))


class VerifiedBlobs(Mapping[str, bytes]):
    """An entry's blobs as ``ArtifactCache.get(lazy=True)`` returns them: each read from
    disk and verified (sha256 and size) the first time it is indexed, then kept. Safe to
    index from several threads (a blob two threads ask for at once is read twice)."""

    def __init__(self, sizes: Mapping[str, int], read: Callable[[str], bytes]) -> None:
        self._sizes = dict(sizes)
        self._read = read
        self._held: dict[str, bytes] = {}

    def __getitem__(self, digest: str) -> bytes:
        held = self._held.get(digest)
        if held is not None:
            return held
        if digest not in self._sizes:
            raise KeyError(digest)
        return self._held.setdefault(digest, self._read(digest))

    def __contains__(self, digest: object) -> bool:
        return digest in self._sizes

    def __iter__(self) -> Iterator[str]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)


@dataclass(frozen=True)
class CacheEntry:
    """An entry as a scan sees it (no blob is read)."""

    key: str
    size: int  # bytes of the entry file plus every blob it references
    created: float
    last_used: float
    blobs: Mapping[str, int]  # every blob the entry references -> its stored size
    factors: Mapping[str, str]
    path: str
    signed: bool = False
    # what its writer said the entry is, for people (``put(about=...)``); {} where the
    # writer said nothing (entries written before it was recorded among them)
    about: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheScan:
    """Every entry a scan could read, and what it could not (path, reason)."""

    entries: tuple[CacheEntry, ...]
    unreadable: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    corrupt: int
    entries: int
    size: int
    size_limit: int
    writable: bool = True
    remote_hits: int = 0
    remote_misses: int = 0
    remote_errors: int = 0  # every remote failure, timeouts included
    remote_timeouts: int = 0  # of those, calls that ran past their deadline
    remote_uploads: int = 0


@dataclass(frozen=True)
class RemoteScan:
    """The remote's entry names: those that are cache keys, and those skipped (name,
    reason); a name that is not a key is never made into a path."""

    keys: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    error: str | None = None  # the listing failed (and ``keys`` is empty): why


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    corrupt: tuple[str, ...]  # keys of corrupt entries
    unreadable: tuple[tuple[str, str], ...] = ()  # (path, reason): not checked
    quarantined: bool = False  # the corrupt entries were moved to quarantine
    intact: int = 0  # entries read in full and found whole

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.unreadable


@dataclass(frozen=True)
class PrunePlan:
    """What a prune removes (or, with ``dry_run``, would remove) and the bytes it frees."""

    evicted: tuple[str, ...]  # entry keys, least recently used first
    blobs: tuple[str, ...]  # blob digests no surviving entry references
    temp_files: tuple[str, ...]  # leftovers of writers that died mid-write
    bytes_freed: int
    size_before: int
    size_limit: int
    dry_run: bool = False
    problems: tuple[str, ...] = field(default=())  # what it could not do, and why


@dataclass(frozen=True)
class MissExplanation:
    key: str
    nearest: str | None
    differing: tuple[str, ...]  # factor names that differ from the nearest entry
    # of those, the ones whose fields can be named: "global_state: grad_enabled ..."
    details: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.nearest is None:
            return f"{self.key[:12]}: the cache is empty"
        if self.nearest == self.key:
            return f"{self.key[:12]}: its entry is there but could not serve (see the log)"
        factors = ", ".join(self.differing) or "none (same factors, different key version)"
        said = f" ({'; '.join(self.details)})" if self.details else ""
        return f"{self.key[:12]}: nearest entry {self.nearest[:12]} differs in: {factors}{said}"
