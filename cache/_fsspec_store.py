"""``FsspecStore``: a ``RemoteStore`` on any fsspec filesystem (``s3://``, ``gs://``,
``file://`` on a shared mount, ...), the remote tier's first store.

Objects live under ``<url>/v2/`` (the local layout's name). A put is whole or not at
all: a PUT on an object store, a temp file renamed on a filesystem. Create-if-absent
(leases) is ``O_EXCL`` on a filesystem and a conditional PUT (``If-None-Match: *``) on
S3; other stores cannot, and say so (None). The filesystem is opened at first use: a
process whose local cache serves every call never imports the store's client (s3fs
and botocore take a third of a second).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ._errors import InvalidOptionError
from ._root import LAYOUT


class FsspecStore:
    """Objects by name on the fsspec filesystem ``url`` (``options``: its storage
    options, as ``fsspec.core.url_to_fs`` takes them). A URL fsspec cannot open (an
    unknown protocol, a plain path, a client not installed) is refused here, at once."""

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
        self._local = protocol in ("file", "local")  # a filesystem: rename and O_EXCL
        self._s3 = protocol in ("s3", "s3a")  # an object store with conditional PUT
        self._options = dict(options or {})
        self._opened: tuple[Any, str] | None = None
        self._open_lock = threading.Lock()

    def _open(self) -> tuple[Any, str]:
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
        """Where the names are, on the filesystem: ``<url's path>/v2``."""
        return self._open()[1]

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def __str__(self) -> str:
        return self.url

    # -- RemoteStore -------------------------------------------------------------------
    def get(self, wanted: Sequence[tuple[str, int]]) -> list[bytes | None]:
        """One ranged request per object (concurrent on an object store): an object
        larger than its limit is never read whole."""
        paths = [self.path(name) for name, _ in wanted]
        ends = [limit + 1 for _, limit in wanted]
        found = self.fs.cat_ranges(paths, [0] * len(paths), ends, on_error="return")
        results: list[bytes | None] = []
        for data in found:
            if isinstance(data, FileNotFoundError):
                results.append(None)
            elif isinstance(data, BaseException):
                raise data
            else:
                results.append(bytes(data))
        return results

    def put(self, name: str, data: bytes) -> None:
        path = self.path(name)
        parent = path.rsplit("/", 1)[0]
        if self._local:
            self.fs.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/.precompile-{uuid.uuid4().hex}.tmp"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def create(self, name: str, data: bytes) -> bool | None:
        path = self.path(name)
        if self._local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            return True
        if self._s3:
            try:
                self.fs.pipe_file(path, data, IfNoneMatch="*")
            except FileExistsError:
                return False
            return True
        return None

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    def names(self, folder: str) -> list[str]:
        try:
            found = self.fs.ls(self.path(folder), detail=False)
        except FileNotFoundError:
            base = self.root.rsplit("/", 1)[0]
            if self._local and not self.fs.exists(base):
                raise FileNotFoundError(f"remote directory {base} does not exist") from None
            return []  # a remote nothing was pushed to yet
        return [str(path).rsplit("/", 1)[-1] for path in found]
