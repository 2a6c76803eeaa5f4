"""Traces in Jupyter: what `Trace._repr_html_` shows when a trace is a cell's last value.

For each recorded layer (the first few), the attention weights of its first recorded head
as a table, one row per query and one column per key, each cell shaded by its weight and
masked keys left blank; under it the score bars and the heatmap of that head as inline PNGs
(qkv.trace.render.png). `trace_html(trace, layer=, head=, query=)` picks another view; `figures=False`
leaves the images out. Everything is escaped and self-contained (no script, no file).

Shape legend: t recorded queries, S keys.
"""

from __future__ import annotations

import base64
import html
import math

from qkv.trace.record.export import token_at
from qkv.trace.record.recorder import LayerTrace, Trace
from qkv.trace.record.views import register_html_view

MAX_LAYERS = 3  # layers shown by _repr_html_ (a whole model's trace would be a long page)
MAX_KEYS = 64  # columns in one table


# Every cell carries its own padding: outside Jupyter (GitHub, nbconvert, a bare page) no
# stylesheet pads table cells, and the numbers would run together ("0.160.21").
_CELL = "padding: 2px 6px; text-align: right"


def _shade(weight: float) -> str:
    alpha = 0.0 if math.isnan(weight) else max(0.0, min(1.0, weight))
    return f"{_CELL}; background: rgba(220, 80, 30, {alpha:.2f})"


def weights_table(layer: LayerTrace, tokens: list[str] | None, head: int) -> str:
    """The head's weights, queries down, keys across, as an HTML table."""
    slot = layer.head_slot(head)
    weights = layer.weights[0, slot]  # (t, S)
    visible = layer.mask[0, slot]
    keys = min(layer.num_keys, MAX_KEYS)
    head_row = "".join(f'<th style="{_CELL}">{html.escape(token_at(tokens, s))}</th>' for s in range(keys))
    rows = []
    for r, query in enumerate(layer.queries):
        label = html.escape(token_at(tokens, layer.cache_length + query))
        cells = []
        for s in range(keys):
            if not bool(visible[r, s]):
                cells.append(f'<td style="{_CELL}" title="masked"></td>')
            else:
                w = float(weights[r, s])
                cells.append(f'<td style="{_shade(w)}" title="weight {w:.4f}">{w:.2f}</td>')
        rows.append(f'<tr><th style="{_CELL}">{label}</th>{"".join(cells)}</tr>')
    more = f"<p>(first {keys} of {layer.num_keys} keys)</p>" if keys < layer.num_keys else ""
    caption = (f"layer {layer.index}, head {head}: attention weights (rows: queries, columns: keys; "
               f"blank: masked)")
    return (f'<table style="border-collapse: collapse; font-family: monospace; font-size: 12px">'
            f'<caption>{html.escape(caption)}</caption><tr><th style="{_CELL}"></th>{head_row}</tr>'
            f"{''.join(rows)}</table>{more}")


def figures_caption(layer: LayerTrace, tokens: list[str] | None, head: int, query: int) -> str:
    """Which query the score bars show (the heatmap shows them all), in the book's x(n) counting."""
    position = layer.cache_length + query
    return (f"score bars: query x({position + 1}) \u201c{token_at(tokens, position)}\u201d, head {head}; "
            "heatmap: every recorded query")


def _images(layer: LayerTrace, tokens: list[str] | None, head: int, query: int) -> str:
    from qkv.trace.render.png import heatmap, png_bytes, score_bars  # matplotlib: only when drawn

    parts = []
    for name, figure in (("score bars", score_bars(layer, tokens, head, query)), ("heatmap", heatmap(layer, tokens, head))):
        uri = "data:image/png;base64," + base64.b64encode(png_bytes(figure)).decode("ascii")
        parts.append(f'<img alt="{name}" src="{uri}" style="max-width: 48%; margin-right: 1%">')
    caption = html.escape(figures_caption(layer, tokens, head, query))
    return f'<figure style="margin: 0">{"".join(parts)}<figcaption>{caption}</figcaption></figure>'


def trace_html(trace: Trace, *, layer: int | None = None, head: int | None = None, query: int | None = None,
               figures: bool = True) -> str:
    """HTML for a notebook: one layer (or the first MAX_LAYERS), one head, one query's figures."""
    layers = [trace.layer(layer)] if layer is not None else trace.layers[:MAX_LAYERS]
    sections = []
    for recorded in layers:
        chosen_head = recorded.heads[0] if head is None else head
        chosen_query = recorded.queries[-1] if query is None else query
        title = recorded.name or recorded.kind
        body = weights_table(recorded, trace.tokens, chosen_head)
        if figures:
            body += _images(recorded, trace.tokens, chosen_head, chosen_query)
        sections.append(f"<h4>{html.escape(str(title))} (layer {recorded.index})</h4>{body}")
    rest = len(trace.layers) - len(layers)
    if rest > 0 and layer is None:
        sections.append(f"<p>{rest} more recorded layers: trace_html(trace, layer=N) shows one.</p>")
    return f'<div class="qkv-trace">{"".join(sections)}</div>'


__all__ = ["figures_caption", "trace_html", "weights_table"]


register_html_view(Trace, trace_html)
