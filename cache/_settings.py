"""``PRECOMPILE_*`` switches read from the environment, one parser for all of them: a
typo (``PRECOMPILE_OFFLINE=ture``) is an error naming the variable, never a silent
"on" or "off"."""

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
