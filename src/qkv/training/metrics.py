"""metrics.jsonl (one JSON object per evaluation) and the loss-curve PNG drawn from it.

Each record is written as one whole line and flushed to disk, so a crash loses at most
the line being written; a torn last line is skipped when reading, and any line that is not
a record is skipped when reading and kept when the file is rewritten. On resume, records
after the checkpoint's step are dropped (the resumed run writes them again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qkv.util.atomic import atomic_write_bytes, atomic_write_with

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


class MetricsLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def read(self) -> list[dict[str, Any]]:
        """The records: every line that is a JSON object with a whole-number step."""
        return [r for r in (_record(line) for line in self._lines()) if r is not None]

    def _lines(self) -> list[bytes]:
        if not self.path.is_file():
            return []
        return self.path.read_bytes().splitlines(keepends=True)

    def keep_until(self, step: int) -> None:
        """Drop the records after `step` (atomically), e.g. when resuming from it. Every other
        line stays as it was, except a last line torn by a crash."""
        lines = self._lines()
        if lines and not lines[-1].endswith(b"\n"):
            lines[-1] = b"" if _record(lines[-1]) is None else lines[-1] + b"\n"
        kept = [line for line in lines if (r := _record(line)) is None or r["step"] <= step]
        if kept != lines or not self.path.exists():
            atomic_write_bytes(self.path, b"".join(kept))


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    numbers = [value.get(k) for k in ("step", "tokens_seen", "train_loss", "val_loss")]
    whole = all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers)
    return value if whole and isinstance(value["step"], int) else None


def plot_losses(records: list[dict[str, Any]], path: str | Path, *, title: str = "") -> None:
    """Train and validation loss against tokens seen, with steps on a second axis."""
    # Imported here: matplotlib is only needed at the end of a run, not to start the CLI.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    tokens = [r["tokens_seen"] for r in records]
    ax.plot(tokens, [r["train_loss"] for r in records], label="training loss")
    ax.plot(tokens, [r["val_loss"] for r in records], linestyle="-.", label="validation loss")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right")
    if title:
        fig.suptitle(title)
    if len(records) >= 2 and tokens[-1] > 0:
        steps_per_token = records[-1]["step"] / tokens[-1]
        top = ax.secondary_xaxis(
            "top", functions=(lambda t: t * steps_per_token, lambda s: s / steps_per_token)
        )
        top.set_xlabel("steps")
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png"))
