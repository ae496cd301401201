"""Single flight across machines: a compile lease in the remote store.

Before compiling a key, a process creates ``leases/<key>.json`` (its owner and an
expiry) only if absent (``RemoteStore.create``); the others wait for the entry, or for
the lease to expire (the tier runs that wait, each try under its deadline). A lease is
read like everything else on a remote: one whose expiry is not a finite time at most
``LEASE_SECONDS`` (plus ``CLOCK_SKEW``) from now is expired, so no lease object holds a
key longer than its documented lifetime from the time it is read. Where the store
cannot create if absent there is no lease: two machines can both compile, both results
are valid, the later upload wins, and both processes serve their own.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._remote_layout import entry_name, lease_name
from ._remote_store import RemoteStore

log = logging.getLogger("precompile.cache")
LEASE_SECONDS = 1800.0  # a lease's lifetime: a killed holder blocks nobody longer
CLOCK_SKEW = 300.0  # how far ahead another machine's clock may be and its lease still hold
_MAX_LEASE_BYTES = 4096


@dataclass
class Lease:
    name: str
    owner: str


def try_lease(store: RemoteStore, key: str, owner: str) -> Lease | bool | None:
    """One try at the compile lease of ``key``: a Lease, False while another process
    holds it, or None where there is nothing to wait for: the entry exists, or the
    store cannot make leases exclusive (compile regardless)."""
    if store.exists(entry_name(key)):
        return None
    name = lease_name(key)
    body = json.dumps({"owner": owner, "expires": time.time() + LEASE_SECONDS}).encode()
    created = store.create(name, body)
    if created is None:
        return None
    if created:
        return Lease(name, owner)
    if lease_expired(read_lease(store, name), time.time()):
        log.info("remote lease of %s expired or unreadable; taking it over", key[:12])
        store.delete(name)
        created = store.create(name, body)
        return Lease(name, owner) if created else False
    return False


def read_lease(store: RemoteStore, name: str) -> dict[str, Any] | None:
    """The lease object ``name`` as read (untrusted), None where absent or unreadable."""
    raw = store.get([(name, _MAX_LEASE_BYTES)])[0]
    if raw is None or len(raw) > _MAX_LEASE_BYTES:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def release(store: RemoteStore, lease: Lease) -> None:
    """Remove the lease, if it is still ours (an expired one may have been taken over)."""
    holder = read_lease(store, lease.name)
    if holder is not None and holder.get("owner") == lease.owner:
        store.delete(lease.name)


def lease_expired(holder: Mapping[str, Any] | None, now: float) -> bool:
    """Whether a lease object (as read, untrusted) no longer holds its key: unreadable,
    its expiry not a finite number (``NaN`` and ``Infinity`` parse as JSON), past, or
    further ahead than a lease lives (plus ``CLOCK_SKEW``), which no honest writer makes."""
    expires = None if holder is None else holder.get("expires")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        return True
    try:
        moment = float(expires)
    except OverflowError:  # an int past a float's range
        return True
    return not (math.isfinite(moment) and now <= moment <= now + LEASE_SECONDS + CLOCK_SKEW)
