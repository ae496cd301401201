"""Where the remote tier keeps things in a ``RemoteStore``: the local ``v2`` tree's names
(entries, blobs, tags) plus ``leases/``. A store sees only these names, relative to its
own root; every machine of a fleet must agree on them, whatever store it uses."""

from __future__ import annotations

ENTRIES, TAGS = "entries", "tags"


def entry_name(key: str) -> str:
    return f"{ENTRIES}/{key}.json"


def blob_name(digest: str) -> str:
    return f"blobs/{digest[:2]}/{digest}"


def tag_name(name: str) -> str:
    return f"{TAGS}/{name}"


def lease_name(key: str) -> str:
    return f"leases/{key}.json"
