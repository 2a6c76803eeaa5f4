"""Figures and a page for `qkv explain --model M --keys --png DIR --html FILE`.

What the key anatomy (qkv.trace.explain.keys) measures, drawn so the asymmetry between keys and
values can be seen rather than read off a table:
- `channels`: per layer (rows) and channel (columns), the mean |x| of keys and of values
  side by side, each row divided by its median channel: outlier channels are bright stripes
  in the keys and absent from the values;
- `sink`: the mean attention weight on the first token, per layer and KV head (a local
  layer's row is labelled with its window);
- `rope_bands` (models with RoPE): the RMS of each rotation pair before RoPE against the
  pair's wavelength in tokens, averaged over heads;
- `key_norms`: |k| by position (counted from 1, as every position shown), averaged over
  heads, so the first token's key stands out.

Every figure is laid out by matplotlib's constrained layout, so no title or label is cut.
`keys_page` puts the figures, each with a caption that says what it shows, and the summary
table (the `--json` summary's numbers, every column explained) into one self-contained HTML
file: images inline, every string escaped, nothing fetched.

Shape legend: L layers, H_kv key/value heads per layer, D head size, T tokens.
"""

from __future__ import annotations

import html
import statistics

from matplotlib.figure import Figure

from qkv.trace.render.html import data_uri
from qkv.trace.explain.keys import OUTLIER_RATIO, KeyAnatomy, by_attention, outliers_by_pair


def _by_layer(anatomy: KeyAnatomy, values: list[list[float]]) -> list[list[float]]:
    """Per-head rows averaged over the KV heads of each layer: (L, ...) in layer order."""
    layers: dict[int, list[list[float]]] = {}
    for head, row in zip(anatomy.heads, values):
        layers.setdefault(head.layer, []).append(row)
    return [[statistics.fmean(column) for column in zip(*rows)] for _, rows in sorted(layers.items())]


def _relative(row: list[float]) -> list[float]:
    median = statistics.median(row) or 1e-12
    return [v / median for v in row]


def channels_figure(anatomy: KeyAnatomy) -> Figure:
    keys = [_relative(r) for r in _by_layer(anatomy, [h.keys.magnitude for h in anatomy.heads])]  # (L, D)
    values = [_relative(r) for r in _by_layer(anatomy, [h.values.magnitude for h in anatomy.heads])]
    top = max(max(max(r) for r in keys), max(max(r) for r in values))
    fig = Figure(figsize=(11, 2.2 + 0.18 * len(keys)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, data, what in ((axes[0], keys, "keys"), (axes[1], values, "values")):
        image = ax.imshow(data, aspect="auto", cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        ax.set_title(what)
        ax.set_xlabel("channel")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes), shrink=0.9, label="mean |x| / median channel")
    fig.suptitle(f"{anatomy.model}, {anatomy.tokens} tokens: mean |x| per channel / the median channel "
                 "(mean over KV heads)")
    pairs = outliers_by_pair(anatomy)[:2]
    if pairs:  # the brightest stripes, named as the RoPE pairs they are: a letter per pair, on top
        letters = "ab"
        top_axis = axes[0].secondary_xaxis("top")
        ticks = [(c, letters[i]) for i, p in enumerate(pairs) for c in p["channels"]]
        top_axis.set_xticks([c for c, _ in ticks], [letter for _, letter in ticks], fontsize=8, color="tab:cyan")
        d = anatomy.head_dim
        fig.supxlabel(f"RoPE ({anatomy.rope_layout}, head size {d}) turns channel i together with i + {d // 2}; "
                      "the most frequent outlier pairs: " + ", ".join(
                          f"{letters[i]} = channels {p['channels'][0]} and {p['channels'][1]}"
                          for i, p in enumerate(pairs)), fontsize=9)
    return fig


def sink_figure(anatomy: KeyAnatomy) -> Figure:
    layers = sorted({h.layer for h in anatomy.heads})
    heads = sorted({h.kv_head for h in anatomy.heads})
    grid = [[float("nan")] * len(heads) for _ in layers]  # (L, H_kv)
    for h in anatomy.heads:
        grid[layers.index(h.layer)][heads.index(h.kv_head)] = statistics.fmean(h.sink_mass)
    fig = Figure(figsize=(4.5 + 0.5 * len(heads), 2.0 + 0.18 * len(layers)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(range(len(heads)), [str(h) for h in heads])
    windows = {h.layer: h.window for h in anatomy.heads}
    ax.set_yticks(range(len(layers)), [str(layer) if windows[layer] is None else f"{layer} (local {windows[layer]})"
                                       for layer in layers])
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title("weight on the first token\n(mean over the queries and\nthe query heads sharing the KV head)",
                 fontsize=10)
    fig.colorbar(image, ax=ax, label="sink mass")
    return fig


def rope_bands_figure(anatomy: KeyAnatomy) -> Figure | None:
    bands = [h.band_magnitude for h in anatomy.heads if h.band_magnitude is not None]
    if not anatomy.rope or not bands or not anatomy.wavelengths:
        return None
    mean = [statistics.fmean(column) for column in zip(*bands)]  # (D/2,)
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(anatomy.wavelengths, mean, marker="o", markersize=3)
    ax.set_xscale("log")
    ax.set_xlabel("wavelength of the rotation pair (tokens, log scale)")
    ax.set_ylabel("RMS of the key pair before RoPE")
    ax.set_title("RoPE frequency bands against key magnitude (mean over heads)")
    return fig


def key_norms_figure(anatomy: KeyAnatomy) -> Figure:
    norms = [statistics.fmean(column) for column in zip(*[h.key_norms for h in anatomy.heads])]  # (T,)
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(range(1, len(norms) + 1), norms, marker=".")
    ax.set_xlabel("position (counted from 1)")
    ax.set_ylabel("|k| (mean over heads)")
    ax.set_title("key norms by position")
    return fig


def keys_figures(anatomy: KeyAnatomy) -> dict[str, Figure]:
    figures = {"channels": channels_figure(anatomy), "sink": sink_figure(anatomy),
               "key_norms": key_norms_figure(anatomy)}
    bands = rope_bands_figure(anatomy)
    if bands is not None:
        figures["rope_bands"] = bands
    return figures


_COLUMNS = (("layer", "layer"), ("attention", "attention"), ("window", "window"), ("kv_head", "KV head"),
            ("key_ratio", "key max/median"),
            ("key_ratio_pre_rope", "before RoPE"), ("key_outliers", "key outlier channels"),
            ("stability", "stability"), ("key_outlier_pairs", "RoPE pairs among them"),
            ("value_ratio", "value max/median"), ("value_outliers", "value outlier channels"),
            ("first_key_norm_over_median", "first key norm / median"), ("sink_mass", "sink mass"))

CAPTIONS = {
    "channels": "Mean |x| of every key channel (left) and value channel (right), per layer, over the median "
                "channel: the outlier channels are bright stripes in the keys only.",
    "sink": "Sink mass: the mean attention weight the queries after the first put on the first token, per "
            "layer and KV head.",
    "rope_bands": "Each RoPE rotation pair's RMS before RoPE against its wavelength in tokens: the large "
                  "key channels sit in the slow pairs.",
    "key_norms": "The length of each token's key by position (counted from 1), averaged over the KV heads: "
                 "the first token's key is unlike the rest.",
}


def _legend(anatomy: KeyAnatomy) -> str:
    """What every column of the summary table means, for the page."""
    d = anatomy.head_dim
    pairs = (f" RoPE pairs: in the {anatomy.rope_layout} layout of a head of {d} channels, channel i turns "
             f"together with channel i + {d // 2}; the pairs listed have both channels among the outliers."
             if anatomy.rope_layout else "")
    return ("max/median: the largest channel's mean |x| over the median channel's. Outlier channels: mean "
            f"|x| over {OUTLIER_RATIO:g} times the median channel's. Stability: per key outlier channel, the "
            "share of tokens in which it is among that token's largest |k| channels (as many as there are "
            "outliers; 1 means in every token). First key norm / median: the first token's key length "
            "over the median of the others' (a sink's key is often unlike the rest). Sink mass: the mean "
            "attention weight the queries after the first put on the first token, over the query heads "
            "that share the KV head." + pairs)


def _kind_line(kind: str, summary: dict[str, object]) -> str:
    """One line of the page's local/global summary (qkv.trace.explain.keys.by_attention)."""
    layers = ", ".join(map(str, summary["layers"]))  # type: ignore[call-overload]
    sees = ("each query sees every earlier key" if kind == "global" else
            "each query sees only its last " + ", ".join(map(str, summary["windows"])) + " keys")  # type: ignore[call-overload]
    return (f"{kind.capitalize()} layers ({layers}; {sees}): mean key max/median {summary['key_ratio']}, "
            f"value max/median {summary['value_ratio']}, first key norm / median "
            f"{summary['first_key_norm_over_median']}, sink mass {summary['sink_mass']}.")


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join("+".join(map(str, v)) if isinstance(v, list) else
                         f"{v:.0%}" if isinstance(v, float) else str(v) for v in value) or "-"
    return str(value)


def keys_page(anatomy: KeyAnatomy, rows: list[dict[str, object]], images: dict[str, bytes]) -> str:
    """One self-contained HTML page: the figures inline and the summary table."""
    title = f"Key anatomy of {anatomy.model}"
    rope = ("keys are measured after RoPE, as queries meet them (the 'before RoPE' column: as "
            "the projection makes them)") if anatomy.rope else (
        "this model has no RoPE: learned absolute positions are added to its input, so its keys "
        "have one form")
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in _COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row[key]))}</td>" for key, _ in _COLUMNS) + "</tr>"
        for row in rows
    )
    kinds = by_attention(rows)
    split = "" if set(kinds) <= {"global"} else "<h2>Local and global layers</h2><ul>" + "".join(
        f"<li>{html.escape(_kind_line(kind, summary))}</li>" for kind, summary in kinds.items()) + "</ul>"
    figures = "".join(
        f'<figure><img alt="{html.escape(CAPTIONS.get(stem, stem))}" src="{data_uri(data)}">'
        f'<figcaption>{html.escape(CAPTIONS.get(stem, stem))} ({html.escape(stem)}.png)</figcaption></figure>'
        for stem, data in images.items()
    )
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:80em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}"
        "img{max-width:100%}figure{margin:1em 0}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{anatomy.tokens} tokens; {html.escape(rope)}. "
        "An outlier channel has a mean |x| above 4 times the median channel's.</p>"
        f"{split}{figures}<h2>Per layer and KV head</h2><p class=\"legend\">{html.escape(_legend(anatomy))}</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>"
    )
