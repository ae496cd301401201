"""When an artifact's warm-up runs beside a serving process's calls.

A warm-up in the background starts once the first call has returned (or after a grace
period without one), gives way between its steps while a first call is in progress, stops
at the interpreter's exit, and keeps its error for ``wait``. The artifact says what a
warm-up does; this says when, and holds the thread state that goes with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from ._errors import InvalidOptionError

log = logging.getLogger("precompile.runtime")

# How long a warm-up step waits for a first call in progress before it goes on anyway.
GIVE_WAY_LIMIT_S = 60.0


def warmup_grace() -> float:
    """Seconds a background warm-up leaves to the first call: ``$PRECOMPILE_WARMUP_GRACE``
    (default 1.0; 0 starts at once)."""
    text = os.environ.get("PRECOMPILE_WARMUP_GRACE", "")
    try:
        value = float(text) if text else 1.0
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 3600.0:
        raise InvalidOptionError(
            f"PRECOMPILE_WARMUP_GRACE must be a number of seconds in [0, 3600], got {text!r}"
        )
    return value


def exiting() -> bool:
    """The interpreter is shutting down (its main thread has finished). A background
    warm-up stops at its next step then: it is not a daemon, so the interpreter waits for
    the step it is in, and neither torch's nor our exit handlers (the private build
    directory's removal) run under a thread still inside a kernel."""
    return not threading.main_thread().is_alive()


class WarmUpSchedule:
    """One artifact's warm-up thread, its error, and the first calls it gives way to."""

    def __init__(self) -> None:
        self.called = threading.Event()  # a call has returned (a warm-up may begin)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._foreground = 0  # first calls in progress
        self._foreground_lock = threading.Lock()
        self._start_lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        """What a thread of the parent held at the fork does not exist in the child."""
        self._thread = None
        self._foreground = 0
        self._foreground_lock = threading.Lock()
        self._start_lock = threading.Lock()

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """A first call in progress, for the duration: a warm-up step waits for it."""
        with self._foreground_lock:
            self._foreground += 1
        try:
            yield
        finally:
            with self._foreground_lock:
                self._foreground -= 1

    def give_way(self) -> None:
        """Wait (up to ``GIVE_WAY_LIMIT_S``) while a first call is in progress: a request is
        never queued behind warm-up work beyond the one step already running."""
        deadline = time.monotonic() + GIVE_WAY_LIMIT_S
        while self._foreground and time.monotonic() < deadline and not exiting():
            time.sleep(0.002)

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` in a background thread once the grace period allows (once per
        schedule: a second call while one exists does nothing)."""
        grace = warmup_grace()
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(work, grace), name="precompile-warmup", daemon=False
                )
                self._thread.start()

    def _run(self, work: Callable[[], None], grace: float) -> None:
        try:
            self._await_first_call(grace)
            work()
        except BaseException as exc:  # surfaced by wait()
            if exiting():  # e.g. a thread pool torch shut down at exit; nobody waits
                log.debug("background warm-up stopped at exit: %s", exc)
                return
            log.warning("background warm-up failed: %s", exc)
            self._error = exc

    def _await_first_call(self, grace: float) -> None:
        """Return once the first call has returned, or after ``grace`` seconds without one:
        a server's first request, usually right after the load, then has the process
        (GIL, loader, GPU) to itself instead of queueing behind the warm-up."""
        deadline = time.monotonic() + grace
        while not exiting():
            left = deadline - time.monotonic()
            if left <= 0 or self.called.wait(min(left, 0.05)):
                return

    def wait(self, timeout: float | None = None) -> None:
        """Join the background thread (if any) and re-raise its error."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if self._error is not None:
                raise self._error
