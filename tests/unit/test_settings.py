"""PRECOMPILE_* switches: one parser, and a typo is an error naming the variable (a client
trial found PRECOMPILE_OFFLINE=maybe treated as on and PRECOMPILE_LEAN=abc as on)."""

from __future__ import annotations

import pytest

import precompile
from precompile._offline import is_offline
from precompile.cache import env_flag
from precompile.runtime._lean import lean_enabled


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", None), ("1", True), ("TRUE", True), (" yes ", True), ("on", True),
     ("0", False), ("false", False), ("No", False), ("off", False)],
)  # fmt: skip
def test_switches_read_the_usual_spellings(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: bool | None
) -> None:
    monkeypatch.setenv("PRECOMPILE_TEST_SWITCH", text)
    for default in (False, True):
        assert env_flag("PRECOMPILE_TEST_SWITCH", default) is (
            default if expected is None else expected
        )


@pytest.mark.parametrize(
    ("name", "read"),
    [("PRECOMPILE_OFFLINE", lambda: is_offline(True)), ("PRECOMPILE_LEAN", lean_enabled)],
)
def test_a_misspelt_switch_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, read: object
) -> None:
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(precompile.InvalidOptionError, match=f"{name} must be .*'maybe'"):
        read()  # type: ignore[operator]
    monkeypatch.setenv(name, "0")
    assert read() is False  # type: ignore[operator]  (offline off; lean off)
