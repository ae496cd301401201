"""When a background warm-up runs: after the first call or the grace period, giving way to
first calls in progress, its error kept for wait(). No compile: plain callables."""

from __future__ import annotations

import threading
import time

import pytest

import precompile
from precompile.runtime._warmup import WarmUpSchedule


def test_the_work_waits_for_the_first_call_then_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRECOMPILE_WARMUP_GRACE", "30")
    ran = threading.Event()
    schedule = WarmUpSchedule()
    schedule.start(ran.set)
    assert not ran.wait(0.3)  # no call yet, grace far off
    schedule.called.set()
    schedule.wait(10)
    assert ran.is_set()


def test_the_grace_period_starts_it_without_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRECOMPILE_WARMUP_GRACE", "0")
    ran = threading.Event()
    schedule = WarmUpSchedule()
    schedule.start(ran.set)
    schedule.wait(10)
    assert ran.is_set()


def test_it_starts_once_and_wait_raises_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRECOMPILE_WARMUP_GRACE", "0")
    calls: list[int] = []

    def work() -> None:
        calls.append(1)
        raise RuntimeError("a variant failed to load")

    schedule = WarmUpSchedule()
    schedule.start(work)
    schedule.start(work)
    with pytest.raises(RuntimeError, match="a variant failed to load"):
        schedule.wait(10)
    assert calls == [1]


def test_a_step_gives_way_while_a_first_call_runs() -> None:
    schedule = WarmUpSchedule()
    released = threading.Event()
    waited: list[float] = []

    def step() -> None:
        started = time.monotonic()
        schedule.give_way()
        waited.append(time.monotonic() - started)

    with schedule.foreground():
        worker = threading.Thread(target=step)
        worker.start()
        time.sleep(0.3)
        assert not waited  # still waiting for the call
        released.set()
    worker.join(10)
    assert waited and waited[0] >= 0.25
    started = time.monotonic()
    schedule.give_way()  # nothing in the foreground: no wait
    assert time.monotonic() - started < 0.1


@pytest.mark.parametrize("text", ["soon", "-1", "3601", "nan"])
def test_a_bad_grace_is_refused_before_any_thread(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("PRECOMPILE_WARMUP_GRACE", text)
    schedule = WarmUpSchedule()
    with pytest.raises(precompile.InvalidOptionError, match="PRECOMPILE_WARMUP_GRACE"):
        schedule.start(lambda: None)
    schedule.wait(0)  # no thread was started: nothing to join or raise
