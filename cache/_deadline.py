"""A deadline on every remote call: a server that takes a connection and never answers
must not hold the caller past it (a client's own timeouts and retries add up to minutes).

The call runs in a daemon thread and the caller waits at most its deadline, then goes
on. A call left behind ends when its request does (the client's own timeouts), never
blocks interpreter exit (daemon), and hands a result it produced too late to
``on_late`` (a lease taken after its caller gave up is released there). While
``MAX_LEFT_BEHIND`` calls are still unanswered, a new call fails at once: an
unresponsive remote costs the deadline a few times, not a thread per call forever.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ._errors import InvalidOptionError

log = logging.getLogger("precompile.cache")
T = TypeVar("T")

DEFAULT_REMOTE_TIMEOUT = 5.0  # seconds for one remote operation, transfers aside
TRANSFER_RATE = 8 << 20  # bytes/s: the slowest transfer a deadline still allows for
MAX_LEFT_BEHIND = 8  # unanswered calls a process keeps before failing new ones at once

_lock = threading.Lock()
_left_behind = 0


class RemoteTimeout(TimeoutError):
    """A remote call ran past its deadline (or too many earlier ones are unanswered)."""


def remote_timeout(value: float | None) -> float:
    """``remote_timeout=`` as given, else ``$PRECOMPILE_REMOTE_TIMEOUT``, else 5 s."""
    source = "remote_timeout"
    if value is None:
        text = os.environ.get("PRECOMPILE_REMOTE_TIMEOUT")
        if not text:
            return DEFAULT_REMOTE_TIMEOUT
        source = "PRECOMPILE_REMOTE_TIMEOUT"
        try:
            value = float(text)
        except ValueError:
            raise InvalidOptionError(
                f"{source} must be a number of seconds, got {text!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(f"{source} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise InvalidOptionError(f"{source} must be a finite number of seconds > 0, got {value}")
    return float(value)


def transfer_allowance(size: int) -> float:
    """Seconds a deadline adds for moving ``size`` bytes (at ``TRANSFER_RATE``)."""
    return max(size, 0) / TRANSFER_RATE


def left_behind() -> int:
    """Remote calls given up on that have not ended yet."""
    return _left_behind


def call(
    action: Callable[[], T],
    seconds: float,
    what: str,
    on_late: Callable[[T], Any] | None = None,
) -> T:
    """``action()``'s result or exception, or ``RemoteTimeout`` after ``seconds``."""
    global _left_behind
    if not seconds > 0:
        raise RemoteTimeout("no time left")
    with _lock:
        if _left_behind >= MAX_LEFT_BEHIND:
            raise RemoteTimeout(
                f"{_left_behind} earlier remote calls are still unanswered; not waiting again"
            )
    done = threading.Event()
    outcome: dict[str, Any] = {}
    given_up = [False]

    def work() -> None:
        global _left_behind
        try:
            outcome["value"] = action()
        except BaseException as exc:  # handed to the caller, who re-raises it
            outcome["error"] = exc
        with _lock:
            done.set()
            late = given_up[0]
            if late:
                _left_behind -= 1
        if late and on_late is not None and "value" in outcome:
            try:
                on_late(outcome["value"])
            except Exception as exc:  # best effort: the caller is long gone
                log.debug("remote %s: cleaning up after a late answer failed: %s", what, exc)

    threading.Thread(target=work, name=f"precompile remote {what}", daemon=True).start()
    if not done.wait(seconds):
        with _lock:
            if not done.is_set():
                given_up[0] = True
                _left_behind += 1
                raise RemoteTimeout(f"no answer within {seconds:.1f} s")
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value
