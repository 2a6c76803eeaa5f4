"""Figures of a traced layer with matplotlib (Agg backend: no display needed).

- `keys_plane`: for 2-d keys (the book's d_out = 2), each key and the query as arrows in
  the plane, each key labelled with its dot product with the query;
- `score_bars`: q · k, then scaled by 1/sqrt(d_k), then softmax weights, key by key; keys
  the mask hides are hatched, and a legend says so;
- `heatmap`: the weights, query (row) by key (column), with token labels, the chosen
  query's row outlined;
- `mask_figure`: which keys each query may see (the causal mask);
- `head_grid`: the heatmap of every recorded head of the layer, on one colour scale with one
  colour bar, token labels on the outer axes.

`render_pngs` draws them once; `write_pngs` saves them into a folder, each file atomically.

Shape legend: t recorded queries, S keys.
"""

from __future__ import annotations

import io
from pathlib import Path

from typing import Any

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from qkv.util.atomic import atomic_write_bytes
from qkv.errors import QkvError
from qkv.trace.record.export import query_row, token_at
from qkv.trace.record.recorder import LayerTrace

_MAX_LABELS = 40  # beyond this many tokens, tick labels are thinned



def _new_figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Figure, Any]:
    """A figure with axes, made without pyplot: no global backend switch, nothing to close."""
    squeeze = kwargs.pop("squeeze", True)
    fig = Figure(figsize=kwargs.pop("figsize", None))
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze, **kwargs)

def _labels(layer: LayerTrace, tokens: list[str] | None) -> tuple[list[str], list[str]]:
    keys = [token_at(tokens, s) for s in range(layer.num_keys)]
    queries = [token_at(tokens, layer.cache_length + q) for q in layer.queries]
    return queries, keys


def _ticks(ax, labels: list[str], axis: str) -> None:
    step = max(1, len(labels) // _MAX_LABELS)
    positions = list(range(0, len(labels), step))
    if axis == "x":
        ax.set_xticks(positions, [labels[i] for i in positions], rotation=60, ha="right", fontsize=8)
    else:
        ax.set_yticks(positions, [labels[i] for i in positions], fontsize=8)


def keys_plane(layer: LayerTrace, tokens: list[str] | None, head: int, query: int) -> Figure:
    """The keys and the query as arrows from the origin, on axes with equal scales (one unit
    is as long across as up), so the angles between them, which decide the dot products,
    are drawn true. Labels sit in a column right of the plot, ordered like the arrow tips."""
    if layer.head_dim != 2:
        raise QkvError(f"the keys can be drawn as arrows in a plane only when they are 2-d (d_out = 2), "
                       f"not {layer.head_dim}-d")
    row = query_row(layer, tokens, head, query)
    xs = [k[0] for k in row["keys"]] + [row["query_vector"][0], 0.0]
    ys = [k[1] for k in row["keys"]] + [row["query_vector"][1], 0.0]
    pad = 0.12 * max(max(xs) - min(xs), max(ys) - min(ys), 1e-6)
    x_range = _widened((min(xs) - pad, max(xs) + pad), 0.0)
    y_range = _widened((min(ys) - pad, max(ys) + pad), 0.0)
    # One data unit is the same length across and up: the plot's box takes the data's
    # shape, between 3 and 8 inches a side; a range too narrow for that is widened.
    per_inch = max((x_range[1] - x_range[0]) / 8.0, (y_range[1] - y_range[0]) / 8.0,
                   min(x_range[1] - x_range[0], y_range[1] - y_range[0]) / 3.0,
                   max(x_range[1] - x_range[0], y_range[1] - y_range[0]) / 5.0)
    x_range = _widened(x_range, 3.0 * per_inch)
    y_range = _widened(y_range, 3.0 * per_inch)
    plot_w, plot_h = (x_range[1] - x_range[0]) / per_inch, (y_range[1] - y_range[0]) / per_inch
    left, bottom, top, labels = 0.8, 0.6, 0.8, 2.6  # inches around the plot
    width, height = left + plot_w + labels, bottom + plot_h + top
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((left / width, bottom / height, plot_w / width, plot_h / height))
    ax.set_xlim(*x_range)
    ax.set_ylim(*y_range)
    ax.set_aspect("equal", adjustable="box")  # already so by construction; kept if resized
    qv = row["query_vector"]
    arrows = [(key, "tab:blue" if visible else "tab:gray", 1.5,
               f"k({s + 1}) {token}: q·k = {score:.4f}" if visible and score is not None
               else f"k({s + 1}) {token}: {'outside the window' if outside else 'masked'}, not scored")
              for s, (key, token, score, visible, outside)
              in enumerate(zip(row["keys"], row["key_tokens"], row["scores"], row["visible"],
                               row["outside_window"]))]
    arrows.append((qv, "tab:red", 2.5, f"query q({row['query']['position']}) {row['query']['token']}"))
    # Labels in a column right of the plot, in the order of the arrow tips, so none overlap.
    order = sorted(range(len(arrows)), key=lambda i: arrows[i][0][1])
    for rank, i in enumerate(order):
        (x, y), colour, width, text = arrows[i]
        ax.annotate("", xy=(x, y), xytext=(0, 0), arrowprops={"arrowstyle": "->", "color": colour, "lw": width})
        ax.annotate(text, xy=(x, y), xytext=(1.04, (rank + 0.5) / len(order)), textcoords="axes fraction",
                    fontsize=8, color=colour, va="center", annotation_clip=False,
                    fontweight="bold" if colour == "tab:red" else "normal",
                    arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.4, "alpha": 0.5})
    ax.grid(alpha=0.3)
    ax.set_xlabel("dimension 1")
    ax.set_ylabel("dimension 2")
    ax.set_title("keys and the query in the plane (equal scales);\neach key labelled with q · k",
                 fontsize=11, loc="left")
    return fig


def _widened(span: tuple[float, float], at_least: float) -> tuple[float, float]:
    """`span` widened about its middle to at least `at_least`."""
    low, high = span
    grow = max(0.0, at_least - (high - low)) / 2
    return low - grow, high + grow


def score_bars(layer: LayerTrace, tokens: list[str] | None, head: int, query: int) -> Figure:
    row = query_row(layer, tokens, head, query)
    names = row["key_tokens"]
    fig, axes = _new_figure(1, 3, figsize=(max(9, 0.5 * len(names) * 3), 3.6))
    panels = (("scores q · k", row["scores"], "tab:blue"),
              (f"scaled: × 1/sqrt(d_k) = {row['scale']:.4f}", row["scaled_scores"], "tab:purple"),
              ("weights: softmax (sum 1)", row["weights"], "tab:orange"))
    for ax, (title, values, colour) in zip(axes, panels):
        shown = [0.0 if v is None else v for v in values]
        bars = ax.bar(range(len(shown)), shown, color=colour)
        for bar, visible, outside in zip(bars, row["visible"], row["outside_window"]):
            if not visible:
                bar.set_hatch(".." if outside else "//")
                bar.set_alpha(0.3)
        ax.set_title(title, fontsize=10)
        ax.axhline(0, color="black", lw=0.5)
        _ticks(ax, names, "x")
    masked = not all(row["visible"])
    if masked:  # below the panels, where it hides no bar
        handles = []
        if any(not v and not o for v, o in zip(row["visible"], row["outside_window"])):
            hidden = "hatched: a key the mask hides (its q · k is discarded: scaled = -inf, weight 0)"
            handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label=hidden))
        if any(row["outside_window"]):
            outside = (f"dotted: a key outside this local layer's window of {row['window']} "
                       "(discarded: scaled = -inf, weight 0)")
            handles.append(Patch(facecolor="white", edgecolor="gray", hatch="..", label=outside))
        fig.legend(handles=handles, fontsize=8, loc="lower center", frameon=False, ncols=len(handles))
    fig.suptitle(f"query x({row['query']['position']}) = \"{row['query']['token']}\", "
                 f"layer {layer.index}, head {head}", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1) if masked else (0, 0, 1, 1))
    return fig


def _draw_heatmap(ax, layer: LayerTrace, tokens: list[str] | None, head: int, *, labels: bool,
                  keys_axis: bool = True, queries_axis: bool = True, vmax: float | None = None) -> None:
    """`labels`: token tick labels, on the key axis and the query axis as asked; `vmax`: the
    top of the colour scale (default: this head's largest weight)."""
    weights = layer.weights[0, layer.head_slot(head)].float().numpy()  # (t, S)
    top = max(float(weights.max()), 1e-9) if vmax is None else vmax
    ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=top, aspect="auto")
    queries, keys = _labels(layer, tokens)
    if labels and keys_axis:
        _ticks(ax, keys, "x")
        ax.set_xlabel("key (column)")
    else:
        ax.set_xticks([])
    if labels and queries_axis:
        _ticks(ax, queries, "y")
        ax.set_ylabel("query (row)")
    else:
        ax.set_yticks([])


def heatmap(layer: LayerTrace, tokens: list[str] | None, head: int, query: int | None = None) -> Figure:
    """`query` (from 0, among the new tokens; None: none marked): its row is outlined in red and
    its label is bold red, so the story's query can be found among the others."""
    queries, keys = _labels(layer, tokens)
    width = min(14.0, 3.0 + 0.35 * len(keys))
    height = min(12.0, 2.5 + 0.35 * len(queries))  # one recorded query: one short row
    fig, ax = _new_figure(figsize=(width + 1.5, height))
    _draw_heatmap(ax, layer, tokens, head, labels=True)
    weights = layer.weights[0, layer.head_slot(head)]
    if weights.numel() <= 144:
        for i in range(weights.shape[0]):
            for j in range(weights.shape[1]):
                w = float(weights[i, j])
                ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if w < 0.5 * float(weights.max()) else "black")
    ax.figure.colorbar(ax.images[0], ax=ax, label="attention weight")
    title = f"attention weights, layer {layer.index}, head {head}"
    if query is not None and query in layer.queries:
        row = layer.queries.index(query)
        ax.add_patch(Rectangle((-0.5, row - 0.5), len(keys), 1, fill=False, edgecolor="red", lw=2))
        step = max(1, len(queries) // _MAX_LABELS)
        if row % step == 0:
            label = ax.get_yticklabels()[row // step]
            label.set_color("red")
            label.set_fontweight("bold")
        title += f"; the query x({layer.cache_length + query + 1}) outlined"
    ax.set_title(title)
    fig.tight_layout()
    return fig


def mask_figure(layer: LayerTrace, tokens: list[str] | None) -> Figure:
    queries, keys = _labels(layer, tokens)
    width = min(12.0, 2.5 + 0.3 * len(keys))
    height = min(10.0, 2.5 + 0.3 * len(queries))
    fig, ax = _new_figure(figsize=(width + 1, height))
    visible = layer.mask[0, 0].float()  # (t, S)
    title = f"{'causal mask' if layer.causal else 'mask'}: white = visible, black = hidden"
    if layer.window is not None:  # keys before a query's window in grey, apart from later ones
        outside = torch.tensor([layer.outside_window(q) for q in layer.queries])  # (t, S)
        visible = torch.where(outside & ~layer.mask[0, 0], 0.5, visible)
        title = (f"sliding-window causal mask (window {layer.window}): white = visible,\n"
                 "grey = before the query's window, black = after the query")
    ax.imshow(visible.numpy(), cmap="Greys_r", vmin=0, vmax=1, aspect="auto")
    _ticks(ax, keys, "x")
    _ticks(ax, queries, "y")
    ax.set_xlabel("key (column)")
    ax.set_ylabel("query (row)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def head_grid(layer: LayerTrace, tokens: list[str] | None) -> Figure:
    n = len(layer.heads)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(3.2 * cols + 1.5, 3.2 * rows + 0.8), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    top = max(float(layer.weights[0].max()), 1e-9)  # one colour scale for every head
    labels = len(layer.queries) <= _MAX_LABELS and layer.num_keys <= _MAX_LABELS
    for slot, head in enumerate(layer.heads):
        ax = axes[slot // cols][slot % cols]
        last_in_column = slot + cols >= n
        _draw_heatmap(ax, layer, tokens, head, labels=labels, keys_axis=last_in_column,
                      queries_axis=slot % cols == 0, vmax=top)
        ax.set_xlabel("")
        ax.set_ylabel("")
        shared = f" (kv {layer.kv_heads[slot]})" if layer.num_kv_heads != layer.num_heads else ""
        ax.set_title(f"head {head}{shared}", fontsize=9)
    for slot in range(n, rows * cols):
        axes[slot // cols][slot % cols].axis("off")
    fig.colorbar(axes[0][0].images[0], ax=axes.ravel().tolist(), label="attention weight", shrink=0.8)
    fig.supxlabel("key (column)")
    fig.supylabel("query (row)")
    fig.suptitle(f"every recorded head of layer {layer.index}")
    return fig


def layer_figures(layer: LayerTrace, tokens: list[str] | None, head: int, query: int) -> dict[str, Figure]:
    """Every figure that applies, by file stem."""
    figures: dict[str, Figure] = {}
    if layer.head_dim == 2:
        figures["keys_plane"] = keys_plane(layer, tokens, head, query)
    figures["scores"] = score_bars(layer, tokens, head, query)
    figures["heatmap"] = heatmap(layer, tokens, head, query)
    if layer.causal or layer.window is not None:
        figures["causal_mask"] = mask_figure(layer, tokens)
    if len(layer.heads) > 1:
        figures["heads"] = head_grid(layer, tokens)
    return figures


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """A reader never sees half a file (see qkv.util.atomic)."""
    atomic_write_bytes(path, data)


def render_pngs(figures: dict[str, Figure]) -> dict[str, bytes]:
    """Each figure as PNG bytes (and closed), drawn once for the files and the page alike."""
    return {stem: png_bytes(fig) for stem, fig in figures.items()}


def write_pngs(images: dict[str, bytes], folder: str | Path) -> list[Path]:
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise QkvError(f"--png {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise QkvError(f"--png {out}: cannot create the folder ({error.strerror})") from None
    written = []
    for stem, data in images.items():
        path = out / f"{stem}.png"
        write_atomic(path, data)
        written.append(path)
    return written
