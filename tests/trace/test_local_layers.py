"""Local (sliding-window) layers in the trace and the key anatomy: which keys a local layer's
query can see, in the recorded mask, the terminal, the figures and the page, and the key
anatomy summed up for local and global layers apart. A tiny Llama whose layer 1 is local
(tests.windowed_layers) stands in for the families that have such layers."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.trace import trace
from qkv.trace.record.export import layer_summary, query_row
from qkv.trace.render.html import build_page
from qkv.trace.explain.keys import by_attention, key_anatomy, summary_rows
from qkv.trace.render.keys_figures import keys_page
from qkv.trace.render.keys_terminal import render_keys
from qkv.trace.render.png import layer_figures, score_bars
from qkv.trace.render.terminal import render_layer
from tests.windowed_layers import make_local

WINDOW, T = 3, 9
TOKENS = [f"t{i}" for i in range(T)]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    make_local(list(model.attention_layers())[1], WINDOW)
    return model


@pytest.fixture(scope="module")
def recorded(model):
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(3))
    return trace(model, ids, tokens=TOKENS)  # checked against each layer's real output


def test_a_local_layer_records_the_sliding_window_mask_and_puts_no_weight_outside(recorded) -> None:
    local, global_ = recorded.layer(1), recorded.layer(0)
    p = torch.arange(T)
    expected = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - WINDOW)  # (T, S)
    assert torch.equal(local.mask[0, 0], expected)
    assert torch.equal(global_.mask[0, 0], p[None, :] <= p[:, None])
    assert float(local.weights[0][:, ~expected].abs().max()) == 0.0
    torch.testing.assert_close(local.weights[0].sum(-1), torch.ones(4, T))
    assert local.window == WINDOW and global_.window is None
    assert layer_summary(local)["attention"] == "local" and layer_summary(global_)["window"] is None


def test_query_row_tells_keys_before_the_window_from_later_ones(recorded) -> None:
    row = query_row(recorded.layer(1), TOKENS, 0, 6)  # x(7) sees x(5) .. x(7)
    assert row["outside_window"] == [True] * 4 + [False] * 5
    assert row["visible"] == [False] * 4 + [True] * 3 + [False] * 2
    assert not any(query_row(recorded.layer(0), TOKENS, 0, 6)["outside_window"])


def test_the_terminal_marks_keys_outside_the_window(recorded) -> None:
    out = io.StringIO()
    render_layer(Console(file=out, width=120, color_system=None), recorded.layer(1), TOKENS, head=0, query=6)
    text = out.getvalue()
    assert "local: sliding window of 3 keys" in text
    assert text.count("(outside window)") == 4 and text.count("(masked)") == 2
    assert "x(7) sees only the last 3 positions, x(5) to x(7)" in text
    assert "the 4 keys before x(5) lie outside its window" in text
    out = io.StringIO()
    render_layer(Console(file=out, width=120, color_system=None), recorded.layer(0), TOKENS, head=0, query=6)
    assert "outside" not in out.getvalue() and "sliding window" not in out.getvalue()


def test_the_figures_draw_the_window(recorded) -> None:
    local = recorded.layer(1)
    figures = layer_figures(local, TOKENS, 0, 6)
    mask = figures["causal_mask"]
    assert "sliding-window causal mask (window 3)" in mask.axes[0].get_title()
    image = mask.axes[0].images[0].get_array()  # (T, S): 1 visible, 0.5 before the window, 0 after
    assert image[6].tolist() == [0.5] * 4 + [1.0] * 3 + [0.0] * 2
    legend = [t.get_text() for legend in score_bars(local, TOKENS, 0, 6).legends for t in legend.get_texts()]
    assert any("outside this local layer's window of 3" in t for t in legend)
    assert any("the mask hides" in t for t in legend)  # x(8), x(9) come after the query


def test_the_page_marks_keys_outside_the_window(recorded) -> None:
    page = build_page(recorded, title="t", subtitle="s", layer=1, head=0, query=6)
    assert page.count("(outside window)") >= 4  # the story's table, and the explorer's label
    assert '"outside_window": [true, true, true, true, false' in page
    assert "This is a local layer: a query sees only its last 3 keys" in page
    assert '"window": 3' in page and '"window": null' in page


def test_the_key_anatomy_covers_local_and_global_layers_apart(model, recorded) -> None:
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(3))
    anatomy = key_anatomy(model, ids, name="tiny")
    assert [h.window for h in anatomy.heads] == [None, None, WINDOW, WINDOW, None, None]
    # The local layer's sink mass: over the queries whose window still holds the first token.
    weights = recorded.layer(1).weights[0]  # (H, T, S)
    head = next(h for h in anatomy.heads if h.layer == 1 and h.kv_head == 0)
    expected = [round(float(weights[q, 1:WINDOW, 0].mean()), 4) for q in (0, 1)]
    assert head.sink_mass == pytest.approx(expected, abs=2e-4)
    rows = summary_rows(anatomy)
    kinds = by_attention(rows)
    assert kinds["global"]["layers"] == [0, 2] and kinds["local"]["layers"] == [1]
    assert kinds["local"]["windows"] == [WINDOW] and kinds["local"]["heads"] == 2
    local_rows = [r for r in rows if r["attention"] == "local"]
    assert kinds["local"]["sink_mass"] == pytest.approx(
        sum(r["sink_mass"] for r in local_rows) / 2, abs=1e-4)
    out = io.StringIO()
    render_keys(Console(file=out, width=80, color_system=None), anatomy, rows)
    text = out.getvalue()
    assert "Global layers (0, 2): each query sees every earlier key." in text
    assert "Local layers (1): each query sees only its last 3 keys" in text
    assert "Mean over local layers' heads" in text and "Mean over global layers' heads" in text
    page = keys_page(anatomy, rows, {})
    assert "Local and global layers" in page and "Local layers (1; each query sees only its last 3 keys)" in page


def test_a_soft_capped_scaled_partly_rotated_local_layer_traces_exactly() -> None:
    """Gemma's parts (score scale, soft-capped scores, a window, partial rotary), once
    GroupedQueryAttention has them: the trace's self-check against the layer's output holds."""
    import inspect

    from qkv.attention import GroupedQueryAttention, RotaryEmbedding

    wanted = {"scale", "softcap", "window", "rotary_dim"}
    if not wanted <= set(inspect.signature(GroupedQueryAttention.__init__).parameters):
        pytest.skip("GroupedQueryAttention has no score scale, soft-cap, window or partial rotary yet")
    torch.manual_seed(1)
    layer = GroupedQueryAttention(32, 4, num_kv_heads=2, head_dim=16, scale=0.3, softcap=2.0, window=WINDOW,
                                  rotary_dim=8).eval()
    cos, sin = RotaryEmbedding(8)(torch.arange(T))
    recorded = trace(layer, torch.randn(1, T, 32) * 3, cos=cos, sin=sin).layers[0]
    assert recorded.scale == 0.3 and recorded.window == WINDOW
    finite = recorded.scaled[recorded.mask]
    assert float(finite.abs().max()) < 2.0  # every score capped below the cap
    assert query_row(recorded, None, 0, 6)["outside_window"] == [True] * 4 + [False] * 5
