"""Figures of a score attribution (matplotlib, no pyplot): the top source pairs as stacked
bars, key by key, and the RoPE pairs' shares against their wavelengths.

- `pairs_figure`: one bar per attributed key; the largest (query source × key source) terms
  across those keys, with each layer's heads summed (L3.attn), stacked, positive above zero
  and negative below, the rest as "other"; a black tick marks each key's score, which the
  stack sums to.
- `rope_figure`: for one key, each rotation pair's share of the score with RoPE applied and
  the same pair unrotated, against the pair's wavelength in tokens (log scale).

Shape legend: S attributed keys, D/2 RoPE pairs.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from qkv.trace.explain.attribution import ScoreAttribution
from qkv.trace.render.attribution_view import short

PAIRS_SHOWN = 8


def pairs_figure(result: ScoreAttribution, count: int = PAIRS_SHOWN) -> Figure:
    q_names, k_names, coarse = result.coarse_all()
    pairs = coarse.flatten(1)  # (S, nq'*nk')
    nk = len(k_names)
    chosen = pairs.abs().sum(0).argsort(descending=True)[:count].tolist()
    labels = [f"{q_names[i // nk]} × {k_names[i % nk]}" for i in chosen]
    other = pairs.sum(1) - pairs[:, chosen].sum(1)  # (S,)
    fig = Figure(figsize=(max(6.0, 0.55 * len(result.keys) + 4.0), 4.2))
    ax = fig.subplots()
    xs = list(range(len(result.keys)))
    up = [0.0] * len(xs)
    down = [0.0] * len(xs)
    colours = [f"C{i % 10}" for i in range(count)] + ["#bbbbbb"]
    series = [pairs[:, i].tolist() for i in chosen] + [other.tolist()]
    for label, values, colour in zip(labels + ["other terms"], series, colours):
        bottoms = [up[x] if v >= 0 else down[x] for x, v in enumerate(values)]
        ax.bar(xs, values, bottom=bottoms, color=colour, label=short(label, 30), width=0.7)
        for x, v in enumerate(values):
            if v >= 0:
                up[x] += v
            else:
                down[x] += v
    ax.scatter(xs, result.scores.tolist(), marker="_", s=300, color="black", zorder=3, label="score q·k")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(xs, [short(f"{k + 1} {result.token(k)}", 14) for k in result.keys], rotation=60,
                  ha="right", fontsize=8)
    ax.set_ylabel("term of q·k")
    ax.set_title(f"Why query {result.query + 1} “{short(result.token(result.query))}” scores each key: "
                 f"layer {result.layer}, head {result.head}", fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.subplots_adjust(right=0.68, bottom=0.28)
    return fig


def rope_figure(result: ScoreAttribution, key: int) -> Figure | None:
    """None for a model without RoPE (GPT-2)."""
    if result.bands is None:
        return None
    s = result.slot(key)
    waves = result.wavelengths.tolist()
    fig = Figure(figsize=(7.5, 4.0))
    ax = fig.subplots()
    ax.plot(waves, result.bands_unrotated[s].tolist(), "o", mfc="none", color="tab:gray",
            label="unrotated (content alone)")
    ax.plot(waves, result.bands[s].tolist(), "o", color="tab:blue", label="rotated (as scored)")
    ax.set_xscale("log")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("wavelength of the pair (tokens per turn)")
    ax.set_ylabel("pair's term of q·k")
    ax.set_title(f"RoPE pairs of query {result.query + 1} × key {key + 1} (distance {result.query - key}): "
                 f"layer {result.layer}, head {result.head}", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="best")
    return fig


def attribution_figures(result: ScoreAttribution, key: int) -> dict[str, Figure]:
    figures = {"why_pairs": pairs_figure(result)}
    rope = rope_figure(result, key)
    if rope is not None:
        figures["why_rope_pairs"] = rope
    return figures
