"""PNG figures and the HTML page: they show the recorded numbers, label what they draw,
write atomically, keep user text inert and embed everything they need."""

from __future__ import annotations

import re

import pytest
import torch

from qkv.errors import QkvError
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.trace import trace
from qkv.trace.record.book_example import book_trace
from qkv.trace.render.html import build_page, write_page
from qkv.trace.render.png import head_grid, heatmap, keys_plane, layer_figures, render_pngs, write_pngs
from qkv.book.walkthrough import BOOK_TOKENS, run_walkthrough


def test_book_trace_reuses_the_walkthrough_and_equals_the_traced_book_module():
    from qkv.book import SelfAttention_v1
    from qkv.book.walkthrough import book_inputs

    layer = book_trace().layers[0]
    walk = run_walkthrough(query_position=2)
    torch.testing.assert_close(layer.weights[0, 0, 1], walk.weights)
    torch.manual_seed(123)  # the book's seed, then W_query, W_key, W_value as the book draws them
    traced = trace(SelfAttention_v1(3, 2), book_inputs()).layers[0]
    torch.testing.assert_close(layer.weights, traced.weights)
    torch.testing.assert_close(layer.context, traced.context)


def test_keys_plane_labels_each_key_with_its_dot_product():
    recorded = book_trace()
    layer = recorded.layers[0]
    fig = keys_plane(layer, recorded.tokens, 0, 1)
    texts = [t.get_text() for t in fig.axes[0].texts]
    for s, token in enumerate(BOOK_TOKENS):
        expected = f"k({s + 1}) {token}: q·k = {float(layer.scores[0, 0, 1, s]):.4f}"
        assert expected in texts
    with pytest.raises(QkvError, match="2-d"):
        keys_plane(book_trace(d_out=3).layers[0], recorded.tokens, 0, 1)


@pytest.mark.parametrize("seed, d_out_scale", [(123, 1.0), (5, 1.0), (7, 40.0)])
def test_keys_plane_has_equal_scales_so_angles_are_true(seed: int, d_out_scale: float):
    """After drawing, one data unit is as many pixels across as up, and every arrow stays
    inside the plot, whatever the data's shape (keys stretched 40x along one axis too)."""
    recorded = book_trace(seed=seed)
    layer = recorded.layers[0]
    layer.keys[..., 0] *= d_out_scale
    fig = keys_plane(layer, recorded.tokens, 0, 1)
    render_pngs({"keys_plane": fig})  # draws the figure at its final size
    ax = fig.axes[0]
    origin, right, up = ax.transData.transform([(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)])
    across, upward = right[0] - origin[0], up[1] - origin[1]
    assert across == pytest.approx(upward, rel=1e-3)
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    for x, y in [*layer.keys[0, 0].tolist(), layer.q[0, 0, 1].tolist(), (0.0, 0.0)]:
        assert x0 < x < x1 and y0 < y < y1


def test_keys_plane_marks_masked_keys():
    recorded = book_trace(causal=True)
    texts = [t.get_text() for t in keys_plane(recorded.layers[0], recorded.tokens, 0, 1).axes[0].texts]
    assert "k(3) starts: masked, not scored" in texts and "k(1) Your: q·k = 1.2705" in texts


def test_heatmap_axes_and_labels_and_mask():
    recorded = book_trace(causal=True)
    layer = recorded.layers[0]
    ax = heatmap(layer, recorded.tokens, 0).axes[0]
    assert ax.get_xlabel() == "key (column)" and ax.get_ylabel() == "query (row)"
    assert [t.get_text() for t in ax.get_xticklabels()] == list(BOOK_TOKENS)
    torch.testing.assert_close(torch.tensor(ax.images[0].get_array()), layer.weights[0, 0].float())
    assert set(layer_figures(layer, recorded.tokens, 0, 1)) == {"keys_plane", "scores", "heatmap", "causal_mask"}


def _tiny_gpt_trace():
    torch.manual_seed(1)
    model = GPT2Decoder(GPTConfig(vocab_size=30, context_length=16, emb_dim=16, n_heads=4, n_layers=2)).eval()
    tokens = ["The", "cat", "<b>sat</b>", "on", "it"]
    return trace(model, torch.tensor([[1, 2, 3, 4, 5]]), tokens=tokens)


def test_head_grid_draws_every_recorded_head():
    recorded = _tiny_gpt_trace()
    fig = head_grid(recorded.layers[1], recorded.tokens)
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert titles == ["head 0", "head 1", "head 2", "head 3"]
    for ax, head in zip([ax for ax in fig.axes if ax.images], range(4)):
        torch.testing.assert_close(torch.tensor(ax.images[0].get_array()),
                                   recorded.layers[1].weights[0, head].float())


def test_pngs_are_written_into_the_folder(tmp_path):
    recorded = book_trace()
    written = write_pngs(render_pngs(layer_figures(recorded.layers[0], recorded.tokens, 0, 1)), tmp_path / "figs")
    assert sorted(p.name for p in written) == ["heatmap.png", "keys_plane.png", "scores.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "figs").glob(".*tmp"))  # no temporary file left behind
    (tmp_path / "file").write_text("x")
    with pytest.raises(QkvError, match="not a folder"):
        write_pngs({}, tmp_path / "file")


def test_html_is_self_contained_and_escapes_user_text(tmp_path):
    recorded = _tiny_gpt_trace()
    recorded.tokens[4] = "<script>alert(1)</script>"
    page = build_page(recorded, title="<script>alert(2)</script>", subtitle="s", layer=1, head=2, query=4)
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "\\u003cscript\\u003ealert(1)" in page  # inside the JSON data
    # Nothing to fetch: no external URL in any src/href, images inline.
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:|//)", page)
    assert all(uri.startswith("data:image/png;base64,") for uri in re.findall(r'<img[^>]*src="([^"]+)"', page))
    assert len(re.findall(r"<img", page)) == 4  # score bars, heatmap, causal mask, head grid
    target = write_page(page, tmp_path / "page.html")
    assert target.read_text(encoding="utf-8") == page


def test_bad_html_targets_are_user_errors(tmp_path):
    with pytest.raises(QkvError, match="does not exist"):
        write_page("<html></html>", tmp_path / "missing" / "page.html")
    with pytest.raises(QkvError, match="is a folder"):
        write_page("<html></html>", tmp_path)
