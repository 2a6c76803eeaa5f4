"""qkv.util.progress.slow_step: a step still running after the delay gets one line on stderr
(within the delay, while it runs), a fast step says nothing, 0 says every step up front."""

from __future__ import annotations

import time

import pytest

from qkv.util.progress import STATUS_AFTER_S, slow_step, status_delay


def test_a_slow_step_says_itself_while_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with slow_step("loading the weights", after=0.1):
        time.sleep(0.3)
        assert capsys.readouterr().err == "loading the weights...\n"  # said during the wait, not after
    assert capsys.readouterr().err == ""  # not a terminal: one plain line, no redraws


def test_a_fast_step_says_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with slow_step("loading the weights", after=0.5):
        pass
    time.sleep(0.6)
    assert capsys.readouterr().err == ""


def test_no_delay_says_it_before_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    with slow_step("compiling", after=0):
        assert capsys.readouterr().err == "compiling...\n"


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("2.5", 2.5), ("-1", 0.0), ("soon", STATUS_AFTER_S)])
def test_the_delay_follows_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, expected: float) -> None:
    monkeypatch.setenv("QKV_STATUS_AFTER_S", value)
    assert status_delay() == expected
