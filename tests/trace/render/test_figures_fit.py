"""The figures as a reader sees them: no title, label or caption cut off at the edge, heads
with token labels and one colour bar, a legend for masked bars, the query marked on the
heatmap, key norms by position counted from 1, and the key page's captions in words."""

from __future__ import annotations

import html

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.trace import trace
from qkv.trace.record.book_example import book_trace
from qkv.trace.explain.keys import key_anatomy, summary_rows
from qkv.trace.render.keys_figures import CAPTIONS, key_norms_figure, keys_figures, keys_page
from qkv.trace.render.png import head_grid, heatmap, layer_figures, render_pngs, score_bars


def _texts_outside(fig) -> list[str]:
    """The drawn texts (titles, labels, tick labels, legends) that reach past the figure's
    edge by more than a pixel: what a reader would see cut off."""
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.canvas.get_width_height()
    drawn = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # pixels
    if drawn.x0 >= -1 and drawn.y0 >= -1 and drawn.x1 <= width + 1 and drawn.y1 <= height + 1:
        return []
    outside = []
    for text in fig.findobj(Text):
        box = text.get_window_extent(renderer)
        if text.get_visible() and text.get_text().strip() and (
                box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1):
            outside.append(text.get_text())
    return outside or [f"something drawn at {drawn}"]


def _gqa_trace():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64)
    tokens = ["The", "␣capital", "␣of", "␣France", "␣is"]
    return trace(LlamaForCausalLM(cfg).eval(), torch.tensor([[5, 6, 7, 8, 9]]), tokens=tokens), tokens


def _anatomy():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return key_anatomy(LlamaForCausalLM(cfg).eval(), torch.randint(0, 97, (1, 20)), name="tiny")


def test_no_text_is_cut_off_in_any_figure():
    book = book_trace(causal=True)
    gqa, tokens = _gqa_trace()
    figures = {**layer_figures(book.layers[0], book.tokens, 0, 1),
               **{f"gqa {k}": v for k, v in layer_figures(gqa.layers[0], tokens, 4, 4).items()},
               **{f"keys {k}": v for k, v in keys_figures(_anatomy()).items()}}
    assert {"gqa heads", "keys sink", "keys key_norms", "keys channels", "scores"} <= set(figures)
    for name, fig in figures.items():
        assert _texts_outside(fig) == [], name


def test_heads_have_token_labels_and_one_colour_bar():
    recorded, tokens = _gqa_trace()
    layer = recorded.layers[0]
    fig = head_grid(layer, tokens)
    heads = [ax for ax in fig.axes if ax.images]
    assert len(heads) == 9
    scales = {ax.images[0].get_clim() for ax in heads}
    assert len(scales) == 1  # one scale for all
    assert list(scales)[0] == (0.0, pytest.approx(float(layer.weights[0].max())))
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "attention weight"]
    assert len(bars) == 1 and not bars[0].images
    for slot, ax in enumerate(heads):
        keys = [t.get_text() for t in ax.get_xticklabels()]
        queries = [t.get_text() for t in ax.get_yticklabels()]
        assert keys == (tokens if slot + 4 >= 9 else [])  # the lowest head of each column
        assert queries == (tokens if slot % 4 == 0 else [])  # the first column
        torch.testing.assert_close(torch.tensor(ax.images[0].get_array()), layer.weights[0, slot].float())


def test_masked_bars_have_a_legend_and_open_ones_none():
    causal = book_trace(causal=True)
    legends = score_bars(causal.layers[0], causal.tokens, 0, 1).legends
    assert len(legends) == 1 and "mask" in legends[0].get_texts()[0].get_text()
    assert legends[0].get_patches()[0].get_hatch() == "//"
    masked = [bar for bar in score_bars(causal.layers[0], causal.tokens, 0, 1).axes[0].patches
              if bar.get_hatch() == "//"]
    assert len(masked) == 4  # x(2) sees two of six keys
    plain = book_trace()
    assert score_bars(plain.layers[0], plain.tokens, 0, 1).legends == []


def test_the_heatmap_outlines_the_query():
    recorded = book_trace(causal=True)
    ax = heatmap(recorded.layers[0], recorded.tokens, 0, 3).axes[0]
    outlines = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(outlines) == 1 and outlines[0].get_y() == pytest.approx(2.5) and outlines[0].get_height() == 1
    marked = [t.get_text() for t in ax.get_yticklabels() if t.get_color() == "red"]
    assert marked == ["with"] and "x(4)" in ax.get_title()
    assert not any(isinstance(p, Rectangle) for p in heatmap(recorded.layers[0], recorded.tokens, 0).axes[0].patches)


def test_key_norms_count_positions_from_1():
    anatomy = _anatomy()
    line = key_norms_figure(anatomy).axes[0].lines[0]
    assert list(line.get_xdata()) == list(range(1, anatomy.tokens + 1))
    assert "from 1" in key_norms_figure(anatomy).axes[0].get_xlabel()


def test_the_key_page_captions_say_what_each_figure_shows():
    anatomy = _anatomy()
    images = render_pngs(keys_figures(anatomy))
    page = keys_page(anatomy, summary_rows(anatomy), images)
    for stem in images:
        assert f"<figcaption>{html.escape(CAPTIONS[stem])} ({stem}.png)</figcaption>" in page
    assert "Stability: per key outlier channel" in page and "channel i turns together with channel i + 8" in page


def test_a_gpt2_layer_with_many_keys_still_fits():
    torch.manual_seed(1)
    model = GPT2Decoder(GPTConfig(vocab_size=30, context_length=64, emb_dim=16, n_heads=4, n_layers=1)).eval()
    tokens = [f"token{i}" for i in range(48)]
    recorded = trace(model, torch.randint(0, 30, (1, 48)), tokens=tokens)
    for name, fig in layer_figures(recorded.layers[0], tokens, 1, 47).items():
        assert _texts_outside(fig) == [], name
