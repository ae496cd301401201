"""A second tier behind the local cache: any fsspec filesystem (``s3://``, ``gs://``,
``file://`` on a shared mount, ...), so a fleet compiles each artifact once.

The remote holds the same layout as the local ``v2`` tree (entries, blobs, tags) plus
``leases/``. Nothing read from it is trusted: an entry is validated like a local one
(and its signature checked where trusted keys are configured), each blob is checked
against its sha256 and size before it is written into the local cache, and reads are
bounded. Writes go blobs first, entry last (an object store's PUT is atomic; on a
filesystem, temp file and rename), so a reader never sees an entry whose blobs are
missing. A remote that fails (network, permissions, throttling) never fails a call
that can be served or compiled locally: every remote error is logged, counted, and
treated as a miss.

Single flight across machines: before compiling a key, a process takes a lease object
(``leases/<key>.json`` with its owner and an expiry) by creating it only if absent:
``O_EXCL`` on a filesystem, a conditional PUT (``If-None-Match: *``) on S3. Others wait
for the entry (or for the lease to expire; ``ArtifactCache.lock`` runs that wait, each
request under its deadline). A lease is read like everything else here: one whose
expiry is not a finite time at most ``LEASE_SECONDS`` (plus ``CLOCK_SKEW``) from now is
expired, so no lease object holds a key longer than its documented lifetime from the
time it is read. Where the store offers no create-if-absent, a lease is a plain write
and two machines can both compile: both results are valid, the later upload wins, and
both processes serve their own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidOptionError
from ._root import LAYOUT

log = logging.getLogger("precompile.cache")
_MAX_ENTRY_BYTES = 64 << 20
LEASE_SECONDS = 1800.0  # a lease's lifetime: a killed holder blocks nobody longer
CLOCK_SKEW = 300.0  # how far ahead another machine's clock may be and its lease still hold


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


@dataclass
class Lease:
    path: str
    owner: str


class RemoteTier:
    """Entries, blobs, tags and leases on an fsspec filesystem."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        try:
            from fsspec.registry import known_implementations, registry
        except ImportError:  # pragma: no cover - fsspec comes with torch
            raise InvalidOptionError("a remote cache needs fsspec: pip install fsspec") from None
        if not isinstance(url, str) or "://" not in url:
            hint = f" (a directory: file://{os.path.abspath(url)})" if isinstance(url, str) else ""
            raise InvalidOptionError(
                f"remote must be a URL such as s3://bucket/path or file:///shared/dir, got "
                f"{url!r}{hint}"
            )
        protocol = url.split("::")[-1].split("://")[0]
        known = known_implementations.get(protocol)
        if protocol not in registry:
            module = str((known or {}).get("class", "")).rsplit(".", 1)[0]
            if not module or importlib.util.find_spec(module.split(".")[0]) is None:
                hint = (known or {}).get("err", f"fsspec knows no filesystem {protocol!r}")
                raise InvalidOptionError(f"remote {url!r} cannot be opened: {hint}")
        self.url = url
        self.protocol = "file" if protocol == "local" else protocol
        self._options = dict(options or {})
        self._opened: tuple[Any, str] | None = None
        self._open_lock = threading.Lock()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def _open(self) -> tuple[Any, str]:
        """The filesystem and the layout's root, made at first use: a process whose
        local cache serves every call never imports the store's client (s3fs and
        botocore take a third of a second)."""
        with self._open_lock:
            if self._opened is None:
                import fsspec

                try:
                    fs, root = fsspec.core.url_to_fs(self.url, **self._options)
                except (ImportError, ValueError, TypeError) as exc:
                    raise InvalidOptionError(
                        f"remote {self.url!r} cannot be opened: {exc}"
                    ) from None
                self._opened = (fs, root.rstrip("/") + "/" + LAYOUT)
            return self._opened

    @property
    def fs(self) -> Any:
        return self._open()[0]

    @property
    def root(self) -> str:
        return self._open()[1]

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    # -- paths -------------------------------------------------------------------------
    def entry_path(self, key: str) -> str:
        return f"{self.root}/entries/{key}.json"

    def blob_path(self, digest: str) -> str:
        return f"{self.root}/blobs/{digest[:2]}/{digest}"

    def tag_path(self, name: str) -> str:
        return f"{self.root}/tags/{name}"

    def lease_path(self, key: str) -> str:
        return f"{self.root}/leases/{key}.json"

    # -- bytes -------------------------------------------------------------------------
    def read(self, path: str, limit: int) -> bytes | None:
        """The object's bytes, None if absent; refused past ``limit`` bytes. One ranged
        request: a hostile object larger than ``limit`` is never read whole."""
        found = self.read_many([(path, limit)])[0]
        return found

    def read_many(self, wanted: Sequence[tuple[str, int]]) -> list[bytes | None]:
        """Several objects at once (concurrent requests on an object store), each as
        ``read``; any error other than absence is raised."""
        paths = [path for path, _ in wanted]
        ends = [limit + 1 for _, limit in wanted]
        found = self.fs.cat_ranges(paths, [0] * len(paths), ends, on_error="return")
        results: list[bytes | None] = []
        for (path, limit), data in zip(wanted, found, strict=True):
            if isinstance(data, FileNotFoundError):
                results.append(None)
                continue
            if isinstance(data, BaseException):
                raise data
            if len(data) > limit:
                raise ValueError(f"remote object {path} is over {limit} bytes")
            results.append(bytes(data))
        return results

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def write(self, path: str, data: bytes) -> None:
        """Whole or not at all: a temp object renamed on filesystems, a PUT on stores."""
        parent = path.rsplit("/", 1)[0]
        if self.protocol in ("file", "local"):
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/.precompile-{uuid.uuid4().hex}.tmp"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def entries(self) -> list[str]:
        """The name of every ``.json`` object under ``entries/``, without the suffix:
        whatever the remote holds, keys or not (the caller checks each name)."""
        try:
            names = self.fs.ls(f"{self.root}/entries", detail=False)
        except FileNotFoundError:
            base = self.root.rsplit("/", 1)[0]
            if self.protocol in ("file", "local") and not self.fs.exists(base):
                raise FileNotFoundError(f"remote directory {base} does not exist") from None
            return []  # a remote nothing was pushed to yet
        found = [str(n).rsplit("/", 1)[-1] for n in names]
        return sorted(name[:-5] for name in found if name.endswith(".json"))

    def tags(self) -> dict[str, str]:
        """Every tag the remote holds and the text it names (checked by the caller), all
        read in one batch of requests."""
        try:
            paths = self.fs.ls(f"{self.root}/tags", detail=False)
        except FileNotFoundError:
            return {}
        names = [str(path).rsplit("/", 1)[-1] for path in paths]
        datas = self.read_many([(self.tag_path(name), 1024) for name in names])
        return {
            name: raw.decode("ascii", "replace").strip()
            for name, raw in zip(names, datas, strict=True)
            if raw is not None
        }

    # -- leases ------------------------------------------------------------------------
    def _create_exclusive(self, path: str, data: bytes) -> bool | None:
        """Create ``path`` only if absent: True if we did, False if it exists, None where
        the store cannot do that atomically."""
        if self.protocol in ("file", "local"):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            return True
        if self.protocol in ("s3", "s3a"):
            try:
                self.fs.pipe_file(path, data, IfNoneMatch="*")
            except FileExistsError:
                return False
            return True
        return None

    def try_lease(self, key: str) -> Lease | bool | None:
        """One try at the compile lease of ``key``: a Lease, False while another process
        holds it, or None where there is nothing to wait for: the entry exists, or this
        store cannot make leases exclusive (compile regardless)."""
        if self.exists(self.entry_path(key)):
            return None
        path = self.lease_path(key)
        body = json.dumps({"owner": self.owner, "expires": time.time() + LEASE_SECONDS}).encode()
        created = self._create_exclusive(path, body)
        if created is None:
            return None
        if created:
            return Lease(path, self.owner)
        if lease_expired(self._read_lease(path), time.time()):
            log.info("remote lease of %s expired or unreadable; taking it over", key[:12])
            self.remove(path)
            created = self._create_exclusive(path, body)
            return Lease(path, self.owner) if created else False
        return False

    def _read_lease(self, path: str) -> dict[str, Any] | None:
        try:
            raw = self.read(path, 4096)
            value = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def release(self, lease: Lease) -> None:
        holder = self._read_lease(lease.path)
        if holder is not None and holder.get("owner") == lease.owner:
            self.remove(lease.path)


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
