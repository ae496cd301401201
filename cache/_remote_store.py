"""``RemoteStore``: what the remote tier needs of a store, and nothing more.

In the style of triton's ``RemoteCacheBackend`` (get and put of bytes by key): a store
holds objects by name (``entries/<key>.json``, ``blobs/ab/<digest>``, ``tags/<name>``,
``leases/<key>.json``; see ``_remote_layout``) and knows nothing of entries, digests,
signatures or deadlines: the tier checks everything it reads, bounds every call, and
treats any exception as a miss. A new store is one class with these six methods;
``FsspecStore`` (any fsspec URL) is the first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ._errors import InvalidOptionError


@runtime_checkable
class RemoteStore(Protocol):
    """Objects by name. Any method may raise: the tier logs it, counts it and goes on
    locally. Names are ``/``-separated and relative to wherever the store keeps them."""

    def get(self, wanted: Sequence[tuple[str, int]]) -> list[bytes | None]:
        """Each named object's bytes, or None where it is absent, in order. Given as
        ``(name, limit)``: reading more than ``limit + 1`` bytes of one is never needed
        (an object over its limit is refused by the tier). Several at once: an entry's
        blobs are fetched in one call, under one deadline."""
        ...

    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` under ``name``, replacing it: whole or not at all, so that no
        reader sees part of an object (the tier writes blobs first, the entry last)."""
        ...

    def create(self, name: str, data: bytes) -> bool | None:
        """Store ``data`` under ``name`` only if absent, atomically: True if this call
        created it, False if it existed, None where the store cannot (then every
        machine compiles what it misses). Leases (single flight across machines)."""
        ...

    def exists(self, name: str) -> bool:
        """Whether ``name`` is held: an upload skips the blobs the remote has."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name`` (absent is no error): a released or expired lease, a blob whose
        bytes fail their own digest."""
        ...

    def names(self, folder: str) -> list[str]:
        """The names directly in ``folder`` (``entries``, ``tags``), without the folder:
        ``[]`` where it holds none; ``FileNotFoundError`` where the store itself is not
        there (``cache ls --remote`` says so instead of "0 entries")."""
        ...


METHODS = ("get", "put", "create", "exists", "delete", "names")


def as_store(remote: object) -> RemoteStore:
    """``remote`` as a ``RemoteStore``, or ``InvalidOptionError`` naming what it lacks."""
    if isinstance(remote, type):  # its methods are there, unbound: every call would fail
        raise InvalidOptionError(
            f"remote must be a URL or a RemoteStore object; got the class {_short(remote)}: "
            "make one (call it) and pass that"
        )
    missing = [name for name in METHODS if not callable(getattr(remote, name, None))]
    if missing or not isinstance(remote, RemoteStore):
        raise InvalidOptionError(
            f"remote must be a URL or a RemoteStore; {_short(remote)} lacks the "
            f"method{'s' * (len(missing) > 1)} "
            f"{', '.join(missing)} (a RemoteStore has {', '.join(METHODS)})"
        )
    return remote


def open_remote(remote: object, options: Mapping[str, Any] | None) -> RemoteStore:
    """The store ``remote`` names: a URL (opened by fsspec with ``options``) or a store."""
    if isinstance(remote, str):
        from ._fsspec_store import FsspecStore  # fsspec is imported when a URL is given

        return FsspecStore(remote, options)
    if options:
        raise InvalidOptionError(
            "remote_options are fsspec's storage options, for a URL remote; "
            f"a store object is configured when it is made, got {_short(options)}"
        )
    return as_store(remote)


def remote_from_env() -> tuple[str | None, dict[str, Any]]:
    """``$PRECOMPILE_REMOTE_CACHE`` and ``$PRECOMPILE_REMOTE_CACHE_OPTIONS`` (JSON)."""
    url = os.environ.get("PRECOMPILE_REMOTE_CACHE") or None
    text = os.environ.get("PRECOMPILE_REMOTE_CACHE_OPTIONS")
    options: dict[str, Any] = {}
    if text:
        try:
            options = json.loads(text)
        except ValueError:
            raise InvalidOptionError(
                f"PRECOMPILE_REMOTE_CACHE_OPTIONS must be a JSON object, got {text!r:.80}"
            ) from None
        if not isinstance(options, dict):
            raise InvalidOptionError("PRECOMPILE_REMOTE_CACHE_OPTIONS must be a JSON object")
    return url, options


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
