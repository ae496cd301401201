"""Tags: names for cache entries, one small file each (like huggingface_hub's refs)."""

from __future__ import annotations

import contextlib
import os
import re

from runtime._errors import InvalidOptionError
from runtime._payloads import atomic_file

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


class Tags:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _path(self, name: str) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidOptionError(
                f"tag name must be 1-100 characters of letters, digits, '.', '_' or '-' "
                f"(not starting with '.'), got {name!r}"
            )
        return os.path.join(self.directory, name)

    def set(self, name: str, key: str) -> None:
        with atomic_file(self._path(name)) as handle:
            handle.write(key.encode())

    def get(self, name: str) -> str | None:
        try:
            with open(self._path(name), "rb") as handle:
                return handle.read().decode("ascii", "replace").strip()
        except FileNotFoundError:
            return None

    def all(self) -> dict[str, str]:
        found = {}
        for name in sorted(os.listdir(self.directory)):
            if _NAME.fullmatch(name):
                with contextlib.suppress(OSError):
                    value = self.get(name)
                    if value is not None:
                        found[name] = value
        return found
