"""The book's figure 5.12: training and validation loss against epochs, tokens seen on top.

As the book's plot_losses: the evaluations are spread evenly from 0 to the number of
epochs (torch.linspace(0, num_epochs, len(train_losses))), the validation curve dash-dotted,
integer epoch ticks, and a second x axis of tokens seen aligned by an invisible curve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.util.atomic import atomic_write_with


def plot_book_losses(records: list[dict[str, Any]], epochs: float, path: str | Path) -> None:
    """Write figure 5.12 for the evaluation `records` of a run of `epochs` epochs as PNG
    (or PDF/SVG by the file's extension)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # only at the end of a run
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(records)
    epochs_seen = [epochs * i / (n - 1) for i in range(n)] if n > 1 else [0.0]
    train = [r["train_loss"] for r in records]
    fig = Figure(figsize=(5, 3), dpi=150, layout="tight")
    FigureCanvasAgg(fig)
    ax1 = fig.add_subplot()
    ax1.plot(epochs_seen, train, label="Training loss")
    ax1.plot(epochs_seen, [r["val_loss"] for r in records], linestyle="-.", label="Validation loss")
    ax1.set_xlabel("Epochs")
    ax1.set_ylabel("Loss")
    ax1.legend(loc="upper right")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2 = ax1.twiny()
    ax2.plot([r["tokens_seen"] for r in records], train, alpha=0)  # aligns the top axis' ticks
    ax2.set_xlabel("Tokens seen")
    suffix = Path(path).suffix.lower().lstrip(".") or "png"
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format=suffix if suffix in ("png", "pdf", "svg") else "png"))
