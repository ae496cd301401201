"""The cache's hit, miss, eviction and corrupt counts: one small JSON file."""

from __future__ import annotations

import json

from ._bytes import atomic_file

FIELDS = (
    "hits",
    "misses",
    "evictions",
    "corrupt",
    "remote_hits",
    "remote_misses",
    "remote_errors",
    "remote_timeouts",
    "remote_uploads",
)


class Counters:
    """Counts kept across processes; the caller holds the cache's "stats" lock to add."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> dict[str, int]:
        """The counts, all zero where the file is missing or unreadable."""
        try:
            with open(self.path, "rb") as handle:
                data = json.loads(handle.read())
            return {k: int(data.get(k, 0)) for k in FIELDS}
        except (OSError, ValueError, TypeError, AttributeError):
            return dict.fromkeys(FIELDS, 0)

    def add(self, field: str, amount: int = 1) -> None:
        counts = self.read()
        counts[field] += amount
        with atomic_file(self.path) as handle:
            handle.write(json.dumps(counts).encode())
