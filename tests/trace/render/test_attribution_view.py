"""The legend of "why this key" (qkv.trace.render.attribution_legend) on real splits of tiny
random GPT-2 (position embedding, LayerNorm shift, output biases, no RoPE) and Qwen2 (RoPE)
decoders, both with q/k biases: every kind of source the output names is defined with one of its
own names, the signed shares, RoPE's columns, the sink column and the figures' grouping by
layer are said, in 80 columns, and the same legend is in the HTML section."""

from __future__ import annotations

import html
import re

import pytest
import torch

import qkv
from qkv.trace.explain.attribution import attribute
from qkv.trace.explain.sink import explain_sinks
from qkv.trace.render.attribution_legend import (TITLE, legend_lines, row_sentences, sink_sentences,
                                                 why_sentences)
from qkv.trace.render.attribution_view import attribution_html, sink_lines, term_lines

T = 9
KINDS = {  # a source name's kind -> the pattern of its names
    "head": r"L\d+\.H\d+", "mlp": r"L\d+\.mlp", "output bias": r"L\d+\.o_bias", "embed": r"embed",
    "pos": r"pos", "norm shift": r"norm shift", "q bias": r"q bias", "k bias": r"k bias",
}


@pytest.fixture(scope="module")
def split(tiny_decoder):
    """kind -> (model, ids, the split of the last query at the last layer)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            folder, _ = tiny_decoder(kind)
            model, _ = qkv.load_pretrained(folder)
            torch.manual_seed(3)
            ids = torch.randint(0, 96, (1, T))
            made[kind] = (model, ids, attribute(model, ids, layer=1, head=1, query=T - 1))
        return made[kind]

    return make


def _read(lines: list[str]) -> str:
    """The legend under `lines`, its wrapped lines joined back into sentences."""
    return " ".join(" ".join(lines[lines.index(TITLE):]).split())


def _kinds(names: list[str]) -> set[str]:
    return {kind for kind, pattern in KINDS.items() for name in names if re.fullmatch(pattern, name)}


def _defined(text: str, names: list[str]) -> set[str]:
    """The kinds the legend defines as `NAME = ...` with NAME one of the split's own sources."""
    return {kind for kind, pattern in KINDS.items()
            if any(f"{name} = " in text for name in names if re.fullmatch(pattern, name))}


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_the_legend_defines_every_source_kind_and_column_shown(kind, split):
    _, _, result = split(kind)
    key = result.keys[0]
    names = result.query_sources + result.key_sources
    lines = term_lines(result, key) + [""] + legend_lines(why_sentences(result, key))
    legend = _read(lines)
    assert max(len(line) for line in lines) <= 80
    assert _defined(legend, names) == _kinds(names)
    assert {"embed", "head", "mlp"} <= _kinds(names)
    assert ({"pos", "norm shift", "output bias"} <= _kinds(names)) == (kind == "gpt2")
    assert {"q bias", "k bias"} <= _kinds(names)  # GPT-2's c_attn and Qwen2's projections have biases
    assert "query source" in legend and "key source" in legend
    assert f"query {result.query + 1}'s" in legend and f"key {key + 1}'s" in legend
    assert "share = term / score" in legend and "negative or over 100%" in legend
    assert f"{result.scale:.4f}" in legend and "1/sqrt(d_k)" in legend
    rope = all(word in legend for word in ("RoPE", "wavelength", "angle", "rotated", "unrotated"))
    assert rope == (result.bands is not None) == (kind == "qwen2")
    layer_groups = result.coarse(key)[0]  # what the figures and the by-layer table draw
    said = re.search(r"\((L\d+\.attn)\); this list is by head \((L\d+\.H\d+)\)", legend)
    assert said and said.group(1) in layer_groups and said.group(2) in names


def test_a_legend_line_stays_in_80_columns_whatever_the_sentence():
    lines = legend_lines(["word " * 60, "x" * 30 + " " + "y" * 30])
    assert lines[0] == TITLE and max(len(line) for line in lines) <= 80


def test_the_row_view_legend_names_its_sources(split):
    _, _, result = split("qwen2")
    names = result.query_sources + result.key_sources
    legend = " ".join(row_sentences(result))
    assert _defined(legend, names) == _kinds(names) and "largest term" in legend


def test_the_html_section_carries_the_same_legend(split):
    _, _, result = split("qwen2")
    key = result.keys[-1]
    page = attribution_html(result, key)
    for sentence in why_sentences(result, key, page=True):
        assert f"<li>{html.escape(sentence)}</li>" in page
    assert "By layer (heads summed)" in page and "The by-layer table and the figures" in page


def test_the_sink_legend_labels_the_sink_column(split):
    model, ids, _ = split("qwen2")
    sinks = explain_sinks(model, ids, count=2)
    lines = sink_lines(sinks) + [""] + legend_lines(sink_sentences(sinks))
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.lstrip().startswith("layer"))
    assert header.split()[:5] == ["layer", "head", "sink", "score", "share"]
    legend = _read(lines)
    assert "sink = the mean weight" in legend and "first token" in legend
    assert "share = the 3 largest terms / score" in legend and "negative or over 100%" in legend
    names = [n for s in sinks for n in s.query_sources + s.key_sources]
    assert _defined(legend, names) == _kinds(names)
    assert "Sources" not in " ".join(sink_sentences(sinks, sources=False))
