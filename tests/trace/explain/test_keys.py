"""Key anatomy: statistics recomputed from their definitions on tiny models."""

from __future__ import annotations

import torch

from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.trace.explain.keys import channel_stats, key_anatomy, summary_rows


def test_channel_stats_find_a_planted_outlier_channel() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 16)
    x[:, 5] += 20.0  # a channel far from zero in every token
    stats = channel_stats(x)
    assert stats.outliers == [5] and stats.stability == [1.0]
    mag = x.abs().mean(0)
    assert abs(stats.max_over_median - float(mag.max() / mag.median())) < 1e-2


@torch.no_grad()
def test_llama_anatomy_covers_every_layer_and_kv_head_with_rope() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (1, 20))
    anatomy = key_anatomy(model, ids, name="tiny")
    assert anatomy.rope and len(anatomy.wavelengths) == 8
    assert [(h.layer, h.kv_head) for h in anatomy.heads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for head in anatomy.heads:
        assert len(head.keys.magnitude) == 16 and head.keys_pre_rope is not None
        assert len(head.key_norms) == 20 and len(head.sink_mass) == 2
        assert all(0.0 <= m <= 1.0 for m in head.sink_mass)
        assert len(head.band_magnitude) == 8
    rows = summary_rows(anatomy)
    assert len(rows) == 4 and all(r["key_ratio"] >= 1.0 for r in rows)


@torch.no_grad()
def test_gpt2_has_no_rope_and_says_so() -> None:
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=50, context_length=32, emb_dim=32, n_heads=2, n_layers=1,
                               drop_rate=0.0)).eval()
    anatomy = key_anatomy(model, torch.randint(0, 50, (1, 10)))
    assert not anatomy.rope and anatomy.wavelengths is None
    assert all(h.keys_pre_rope is None and h.band_magnitude is None for h in anatomy.heads)
    assert len(anatomy.heads) == 2


@torch.no_grad()
def test_figures_draw_the_anatomy_numbers_and_the_page_holds_the_summary() -> None:
    import statistics

    from qkv.trace.render.keys_figures import channels_figure, keys_figures, keys_page, sink_figure
    from qkv.trace.render.png import render_pngs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    anatomy = key_anatomy(LlamaForCausalLM(cfg).eval(), torch.randint(0, 97, (1, 20)), name="<tiny & co>")
    # The channel image of layer 1 is the mean over its KV heads of mean |k|, over the median channel.
    layer1 = [h.keys.magnitude for h in anatomy.heads if h.layer == 1]
    mean = [statistics.fmean(c) for c in zip(*layer1)]
    expected = [m / statistics.median(mean) for m in mean]
    drawn = channels_figure(anatomy).axes[0].images[0].get_array()[1]
    assert max(abs(float(a) - b) for a, b in zip(drawn, expected)) < 1e-9
    sink = sink_figure(anatomy).axes[0].images[0].get_array()
    for h in anatomy.heads:
        assert abs(float(sink[h.layer][h.kv_head]) - statistics.fmean(h.sink_mass)) < 1e-12
    images = render_pngs(keys_figures(anatomy))
    assert set(images) == {"channels", "sink", "key_norms", "rope_bands"}
    assert all(data[:8] == b"\x89PNG\r\n\x1a\n" for data in images.values())
    rows = summary_rows(anatomy)
    page = keys_page(anatomy, rows, images)
    assert "&lt;tiny &amp; co&gt;" in page and "<tiny" not in page  # the name is escaped
    assert page.count("<tr>") == len(rows) + 1 and page.count("data:image/png;base64,") == 4
    assert f"<td>{rows[0]['sink_mass']:.4g}</td>" in page
