"""Progress bars, one rule for every command: drawn on stderr only when stderr is a
terminal. A bar redraws itself with carriage returns; in a log file or a pipe that is
noise, so there the bar is off and the command's own lines are all that is written.

A wait without a count (loading a file, a compiler running) is a `slow_step`: a line that
says what runs once it has run a second, counting seconds on a terminal."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm


def progress_bar(*, total: int, desc: str, unit: str, enabled: bool = True, **options: Any) -> tqdm:
    """A tqdm bar on stderr; off when `enabled` is false or stderr is not a terminal."""
    stream = sys.stderr
    shown = enabled and hasattr(stream, "isatty") and stream.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not shown,
                dynamic_ncols=True, **options)


STATUS_AFTER_ENV = "QKV_STATUS_AFTER_S"
STATUS_AFTER_S = 1.0  # a step this long gets a line: "visible progress within 1 s of every wait"


def status_delay() -> float:
    """Seconds a step runs before `slow_step` says what it is doing: $QKV_STATUS_AFTER_S
    (0: every step says so at its start), else STATUS_AFTER_S."""
    try:
        return max(0.0, float(os.environ.get(STATUS_AFTER_ENV, STATUS_AFTER_S)))
    except ValueError:
        return STATUS_AFTER_S


@contextlib.contextmanager
def slow_step(message: str, *, after: float | None = None) -> Iterator[None]:
    """Say `message...` on stderr once the step inside has run `after` seconds (default:
    status_delay()), so a wait of seconds is never silent and a fast step says nothing. On a
    terminal the line counts the seconds and ends with the step's time; in a pipe or a log
    it is one plain line."""
    delay = status_delay() if after is None else after
    stream = sys.stderr
    terminal = hasattr(stream, "isatty") and stream.isatty()
    start = time.monotonic()
    done, shown = threading.Event(), threading.Event()

    def say() -> None:
        shown.set()
        stream.write(f"{message}..." + ("" if terminal else "\n"))
        stream.flush()

    def watch() -> None:
        if not shown.is_set() and done.wait(delay):
            return
        if not shown.is_set():
            say()
        while terminal and not done.wait(1.0):
            stream.write(f"\r{message}... {time.monotonic() - start:.0f} s")
            stream.flush()

    if delay <= 0:
        say()  # before the step starts: the line's order on stderr is the steps' order
    watcher = threading.Thread(target=watch, name="qkv-slow-step", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        if shown.is_set() and terminal:
            stream.write(f"\r{message}... {time.monotonic() - start:.1f} s\n")
            stream.flush()
