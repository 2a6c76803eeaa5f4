"""metrics.jsonl (one JSON object per evaluation) and the loss-curve PNG drawn from it.

Each record is written as one whole line and flushed to disk, so a crash loses at most
the line being written; a torn last line is skipped when reading. On resume, records
after the checkpoint's step are dropped (the resumed run writes them again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qkv.atomic import atomic_write_text, atomic_write_with

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
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a crash
        return records

    def keep_until(self, step: int) -> None:
        """Drop the records after `step` (atomically), e.g. when resuming from it."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))


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
