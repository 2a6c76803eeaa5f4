"""Progress bars, one rule for every command: drawn on stderr only when stderr is a
terminal. A bar redraws itself with carriage returns; in a log file or a pipe that is
noise, so there the bar is off and the command's own lines are all that is written."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress_bar(*, total: int, desc: str, unit: str, enabled: bool = True, **options: Any) -> tqdm:
    """A tqdm bar on stderr; off when `enabled` is false or stderr is not a terminal."""
    stream = sys.stderr
    shown = enabled and hasattr(stream, "isatty") and stream.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not shown,
                dynamic_ncols=True, **options)
