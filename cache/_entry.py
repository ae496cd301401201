"""What a cache scan returns: frozen records of entries, stats and verification."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEntry:
    key: str
    size: int  # bytes of the entry file plus every blob it references
    created: float
    last_used: float
    variants: int
    payloads: tuple[str, ...]
    factors: Mapping[str, str]
    path: str


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    corrupt: int
    entries: int
    size: int
    size_limit: int


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    corrupt: tuple[str, ...]  # keys moved to quarantine

    @property
    def ok(self) -> bool:
        return not self.corrupt


@dataclass(frozen=True)
class MissExplanation:
    key: str
    nearest: str | None
    differing: tuple[str, ...]  # factor names that differ from the nearest entry

    def __str__(self) -> str:
        if self.nearest is None:
            return f"{self.key[:12]}: the cache is empty"
        factors = ", ".join(self.differing) or "none (same factors, different key version)"
        return f"{self.key[:12]}: nearest entry {self.nearest[:12]} differs in: {factors}"
