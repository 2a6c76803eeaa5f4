"""metrics.jsonl survives a torn line and is trimmed on resume; the loss plot is a real PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image

from qkv.training.metrics import MetricsLog, plot_losses


def test_metrics_skip_a_torn_line_and_trim_on_resume(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (0, 5, 10):
        log.append({"step": s, "tokens_seen": s * 8, "train_loss": 5.0 - s / 10, "val_loss": 5.1})
    with open(log.path, "a") as handle:
        handle.write('{"step": 15, "tok')  # a crash mid-line
    assert [r["step"] for r in log.read()] == [0, 5, 10]
    log.keep_until(5)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [0, 5]


def test_loss_plot_is_a_png(tmp_path: Path) -> None:
    records = [
        {"step": s, "tokens_seen": 64 * s, "train_loss": 6 - s / 5, "val_loss": 6 - s / 8} for s in range(0, 20, 4)
    ]
    path = tmp_path / "loss.png"
    plot_losses(records, path, title="t")
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn
