"""The key anatomy in a terminal: RoPE pairs computed from the head size and layout (checked
against the rotations themselves), one line per layer and KV head in an 80-column pipe with
whole headers, every column explained, and two outlier channels of one pair named as a pair."""

from __future__ import annotations

import io
import os
import re

import pytest
import torch
from rich.console import Console

from qkv.attention.rope import RotaryEmbedding, apply_rope
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.trace.explain.keys import key_anatomy, outliers_by_pair, rope_partner, summary_rows
from qkv.trace.render.keys_terminal import OUTLIERS_WIDTH, _outliers, render_keys


def _touched(rotated: torch.Tensor) -> set[int]:
    return {int(i) for i in (rotated.abs() > 1e-6).nonzero().flatten()}


@pytest.mark.parametrize("head_dim", [8, 64])
def test_rotate_half_pairs_are_the_channels_apply_rope_mixes(head_dim: int) -> None:
    cos, sin = RotaryEmbedding(head_dim)(torch.tensor([3]))  # (1, D): a position that turns every pair
    for channel in range(head_dim):
        one_hot = torch.zeros(1, 1, 1, head_dim)
        one_hot[..., channel] = 1.0
        pair, partner = rope_partner(channel, head_dim)
        assert _touched(apply_rope(one_hot, cos, sin)[0, 0, 0]) == {channel, partner}
        assert pair == min(channel, partner)  # pair i turns at inv_freq[i]
    assert rope_partner(23, 64) == (23, 55) and rope_partner(55, 64) == (23, 23)


def test_interleaved_pairs_are_metas_complex_pairs() -> None:
    head_dim, angle = 8, torch.full((4,), 0.7)
    for channel in range(head_dim):
        one_hot = torch.zeros(head_dim)
        one_hot[channel] = 1.0
        turned = torch.view_as_real(torch.view_as_complex(one_hot.view(4, 2)) * torch.polar(torch.ones(4), angle))
        pair, partner = rope_partner(channel, head_dim, "interleaved")
        assert _touched(turned.flatten()) == {channel, partner} and pair == channel // 2
    for bad in ((3, 7, "rotate-half"), (8, 8, "rotate-half"), (1, 8, "sideways")):
        with pytest.raises(ValueError):
            rope_partner(*bad)


@pytest.fixture(scope="module")
def planted() -> tuple:
    """A tiny Llama whose KV head 0 of layer 1 has a huge RoPE pair (channels 3 and 3 + D/2)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        k_proj = model.model.layers[1].self_attn.k_proj.weight  # (H_kv * D, C)
        k_proj[3] *= 40.0
        k_proj[3 + d // 2] *= 40.0
    anatomy = key_anatomy(model, torch.randint(0, 97, (1, 24)), name="planted")
    return anatomy, summary_rows(anatomy), d


def test_a_planted_pair_is_named_as_one_rope_pair(planted) -> None:
    anatomy, rows, d = planted
    row = next(r for r in rows if (r["layer"], r["kv_head"]) == (1, 0))
    assert row["key_outlier_pairs"] == [[3, 3 + d // 2]]
    assert _outliers(row).startswith(f"3+{3 + d // 2}(")
    assert outliers_by_pair(anatomy)[0] == {"pair": 3, "channels": [3, 3 + d // 2], "heads": 1}


def test_the_table_fits_80_columns_with_whole_headers_and_a_key(planted) -> None:
    anatomy, rows, d = planted
    console = Console(width=80, record=True, color_system=None, file=open(os.devnull, "w"))
    render_keys(console, anatomy, rows)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80 and not any("…" in line for line in lines)
    assert lines[1].split() == ["kv", "key", "key", "outlier", "channels", "value", "value", "1st", "key", "sink"]
    assert lines[2].split() == ["layer", "head", "max/med", "(stability", "%)", "max/med", "outliers", "/median", "mass"]
    body = [line for line in lines if re.match(r"\s+\d+\s+\d+\s", line)]
    assert len(body) == len(rows)  # one line per layer and KV head
    text = " ".join(lines)
    for term in ("stability:", "1st key / median:", "sink mass:", "key max/med:"):
        assert term in text
    assert f"channel i rotates together with channel i + {d // 2}" in text
    assert f"pair 3 = channels 3 and {3 + d // 2}" in text


def test_a_long_outlier_list_is_cut_with_a_count() -> None:
    channels = list(range(20, 31))
    row = {"key_outliers": channels, "stability": [0.5 + i / 40 for i in range(11)], "key_outlier_pairs": []}
    shown = _outliers(row)
    assert len(shown) <= OUTLIERS_WIDTH
    kept, rest = shown.rsplit(" +", 1)
    assert len(kept.split()) + int(rest) == len(channels)
    assert kept.split()[0] == "30(75)"  # the most stable first


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_keys_at_80_columns(smollm2_model) -> None:
    """The real model's table, written as into a pipe (not a terminal, 80 columns)."""
    from qkv.cli.explain.keys import DEFAULT_TEXT

    model, tokenizer = smollm2_model
    anatomy = key_anatomy(model, torch.tensor([tokenizer.encode(DEFAULT_TEXT).ids]), name="smollm2")
    rows = summary_rows(anatomy)
    out = io.StringIO()
    render_keys(Console(file=out, width=80, highlight=False), anatomy, rows)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80 and not any("…" in line for line in lines)
    assert len([line for line in lines if re.match(r"\s+\d+\s+\d+\s", line)]) == len(rows) == 90
    # The most frequent outlier pair, counted from the anatomy, named with both of its channels.
    counts: dict[int, int] = {}
    for head in anatomy.heads:
        for pair in {c % 32 for c in head.keys.outliers}:
            counts[pair] = counts.get(pair, 0) + 1
    top = max(counts, key=lambda p: (counts[p], -p))
    assert f"pair {top} = channels {top} and {top + 32}: {counts[top]}" in " ".join(lines)
