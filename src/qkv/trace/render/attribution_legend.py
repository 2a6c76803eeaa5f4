"""What the words and columns of "why this key" mean, for a reader who has not met them:
the legend under `qkv explain --why` / `--sinks` and in the HTML section.

The split's vocabulary (L19.H4, L16.mlp, embed, query / key source, a share of -39% or
140%, RoPE's wavelength and angle) is exact but terse; the legend names only what the
output in front of the reader shows (a model without RoPE gets no RoPE sentence, one
without biases no bias), with that output's own source names as its examples. The
sentences are plain text: the terminal wraps them to 80 columns, HTML escapes them.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Sequence

from qkv.trace.explain.attribution import ScoreAttribution
from qkv.trace.explain.sink import SinkAttribution

WIDTH = 80
TITLE = "How to read this:"
_HEAD = re.compile(r"L(\d+)\.H(\d+)$")
_MLP = re.compile(r"L(\d+)\.mlp$")
_O_BIAS = re.compile(r"L(\d+)\.o_bias$")


def _first(names: Iterable[str], pattern: re.Pattern[str]) -> re.Match[str] | None:
    return next((m for m in map(pattern.match, names) if m is not None), None)


def source_sentence(names: Sequence[str]) -> str:
    """What each kind of source name in `names` means, the first of each kind as its example.
    `names`: the sources the reader sees first (the largest terms), then all of them."""
    parts = []
    if "embed" in names:
        parts.append("embed = the token embedding")
    if "pos" in names:
        parts.append("pos = the position embedding")
    head = _first(names, _HEAD)
    if head:
        parts.append(f"{head.group(0)} = the output of head {head.group(2)} of layer {head.group(1)}")
    mlp = _first(names, _MLP)
    if mlp:
        parts.append(f"{mlp.group(0)} = layer {mlp.group(1)}'s MLP output")
    o_bias = _first(names, _O_BIAS)
    if o_bias:
        parts.append(f"{o_bias.group(0)} = layer {o_bias.group(1)}'s attention output bias")
    if "norm shift" in names:
        parts.append("norm shift = the LayerNorm's shift")
    for bias, side in (("q bias", "query"), ("k bias", "key")):
        if bias in names:
            parts.append(f"{bias} = the {side} projection's bias")
    return "Sources, what wrote the residual stream (layers, heads from 0): " + "; ".join(parts) + "."


def why_sentences(result: ScoreAttribution, key: int, *, page: bool = False) -> list[str]:
    """The legend of one score's split: under `term_lines` (page=False) or in
    `attribution_html` (page=True, where the by-layer table and the figures sit beside it)."""
    names = [n for q, k, _ in result.top_pairs(key, 12) for n in (q, k)] + result.query_sources + result.key_sources
    sentences = [
        source_sentence(names),
        f"query source / key source: that source's part of query {result.query + 1}'s / key "
        f"{key + 1}'s vector; term = the dot product of the two parts; all terms sum to q·k.",
        f"scaled = term × {result.scale:.4f}, the layer's scale (1/sqrt(d_k) in most models). "
        "share = term / score, signed: "
        "terms cancel, so a share can be negative or over 100%.",
    ]
    if result.bands is not None:
        sentences.append(
            "RoPE pair: two channels turned by angle = distance × 2π / wavelength (in tokens); "
            "rotated = the pair's part of q·k as scored (they sum to q·k), unrotated = the same "
            "without the turn (content alone).")
    head = _first(names, _HEAD)
    if head:
        grouped = "The by-layer table and the figures sum" if page else "The --png/--html figures sum"
        kept = "the table of largest terms is" if page else "this list is"
        sentences.append(f"{grouped} each layer's heads (L{head.group(1)}.attn); {kept} by head "
                         f"({head.group(0)}).")
    return sentences


def row_sentences(result: ScoreAttribution) -> list[str]:
    """The legend of `row_lines` (QUERY:all): one line per key with its largest term."""
    shown = [name for key in result.keys for name in result.top_pairs(key, 1)[0][:2]]
    return [source_sentence(shown + result.query_sources + result.key_sources),
            "largest term = the (query source, key source) pair with the largest part of that "
            "key's q·k, of either sign; weight = softmax of the scaled scores."]


def sink_sentences(sinks: Sequence[SinkAttribution], *, sources: bool = True) -> list[str]:
    """The legend of `sink_lines`; sources=False leaves out the sources sentence (already given)."""
    shown = [name for sink in sinks for q, k, _ in sink.top_pairs(3) for name in (q, k)]
    every = [name for sink in sinks for name in sink.query_sources + sink.key_sources]
    sentences = [
        "sink = the mean weight the queries after the first token put on it (0 to 1); score = "
        "their mean q·k against it; share = the 3 largest terms / score, signed, so it can be "
        "negative or over 100%; key sources carrying it: summed over the query sources."]
    return sentences + [source_sentence(shown + every)] if sources else sentences


def legend_lines(sentences: Sequence[str], width: int = WIDTH) -> list[str]:
    """The legend for the terminal: a title, then each sentence wrapped and indented."""
    lines = [TITLE]
    for sentence in sentences:
        lines += textwrap.wrap(sentence, width, initial_indent="  ", subsequent_indent="  ",
                               break_on_hyphens=False)
    return lines


def legend_html(sentences: Sequence[str]) -> str:
    """The legend for HTML: each sentence escaped, as one list."""
    import html

    items = "".join(f"<li>{html.escape(s)}</li>" for s in sentences)
    return f'<div class="qkv-legend"><h4>{html.escape(TITLE)}</h4><ul>{items}</ul></div>'
