"""Tags: names for cache entries, one small file each (like huggingface_hub's refs)."""

from __future__ import annotations

import os
import re

from . import _files as files
from ._bytes import atomic_file
from ._errors import CacheWriteError, InvalidOptionError

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


class Tags:
    def __init__(self, directory: str, trust_foreign: bool = False) -> None:
        self.directory = directory
        self.trust_foreign = trust_foreign

    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidOptionError(
                f"tag name must be 1-100 characters of letters, digits, '.', '_' or '-' "
                f"(not starting with '.'), got {name!r}"
            )
        return os.path.join(self.directory, name)

    def set(self, name: str, key: str) -> None:
        path = self._path(name)
        try:
            with atomic_file(path) as handle:
                handle.write(key.encode())
        except OSError as exc:
            raise CacheWriteError(exc.errno or 0, f"cannot write tag {name!r}: {exc}") from exc

    def get(self, name: str) -> str | None:
        try:
            raw = files.read_checked(self._path(name), 1024, self.trust_foreign)
        except FileNotFoundError:
            return None
        return raw.decode("ascii", "replace").strip()

    def all(self) -> dict[str, str]:
        found = {}
        for name in files.listing(self.directory):
            if _NAME.fullmatch(name):
                try:
                    value = self.get(name)
                except OSError:
                    continue
                if value is not None:
                    found[name] = value
        return found
