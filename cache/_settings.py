"""``PRECOMPILE_*`` settings read from the environment, one parser per kind: a typo
(``PRECOMPILE_OFFLINE=ture``, ``PRECOMPILE_CACHE_SIZE_LIMIT=1KB``) is an error naming the
variable, never a silent "on", "off" or default."""

from __future__ import annotations

import os

from ._errors import InvalidOptionError

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: 1/true/yes/on or 0/false/no/off (any case); unset or empty
    is ``default``; anything else raises ``InvalidOptionError``."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise InvalidOptionError(
        f"{name} must be 1/true/yes/on or 0/false/no/off, got {os.environ[name]!r}"
    )


def env_bytes(name: str, default: int) -> int:
    """A positive number of bytes from ``name``; unset or empty is ``default``."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidOptionError(f"{name} must be a number of bytes, got {text!r}") from None
    if value <= 0:
        raise InvalidOptionError(f"{name} must be > 0, got {value}")
    return value
