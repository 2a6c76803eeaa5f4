"""GroupedQueryAttention against three references: torch.nn.MultiheadAttention, the book's
MultiHeadAttention (num_kv_heads == num_heads) and transformers' Llama / Qwen3 attention
layers (grouped heads, RoPE, q/k-norm), weights copied across."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from qkv.attention import GroupedQueryAttention, RotaryEmbedding, causal_mask, padding_mask
from qkv.book import MultiHeadAttention

BACKENDS = ("explicit", "fused")


def _copy_from_torch_mha(ours: GroupedQueryAttention, ref: nn.MultiheadAttention) -> None:
    wq, wk, wv = ref.in_proj_weight.chunk(3, dim=0)
    bq, bk, bv = ref.in_proj_bias.chunk(3, dim=0)
    with torch.no_grad():
        for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ours.o_proj.weight.copy_(ref.out_proj.weight)
        ours.o_proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("b,t,c,h", [(1, 1, 4, 1), (2, 7, 24, 3), (3, 12, 32, 8)])
def test_matches_torch_multihead_attention(backend, causal, padded, b, t, c, h):
    torch.manual_seed(b * 100 + t)
    ref = nn.MultiheadAttention(c, h, bias=True, batch_first=True).eval()
    ours = GroupedQueryAttention(c, h, qkv_bias=True, out_bias=True, backend=backend).eval()
    _copy_from_torch_mha(ours, ref)
    x = torch.randn(b, t, c)
    real = torch.ones(b, t, dtype=torch.bool)
    if padded:
        real[0, t // 2 + 1 :] = False  # the first sequence is shorter; key 0 stays real
    hidden = ~causal_mask(t) if causal else None  # torch's convention: True = hidden
    with torch.no_grad():
        expected, _ = ref(
            x, x, x, attn_mask=hidden, is_causal=causal,
            key_padding_mask=~real if padded else None, need_weights=False,
        )
        got = ours(x, mask=padding_mask(real) if padded else None, is_causal=causal)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d_out,h", [(8, 1), (12, 3), (16, 4)])
def test_equals_book_multihead_attention_on_same_weights(backend, d_out, h):
    torch.manual_seed(d_out + h)
    book = MultiHeadAttention(d_out, d_out, context_length=10, dropout=0.0, num_heads=h).eval()
    ours = GroupedQueryAttention(d_out, h, num_kv_heads=h, out_bias=True, backend=backend).eval()
    ours.load_state_dict(
        {
            "q_proj.weight": book.W_query.weight,
            "k_proj.weight": book.W_key.weight,
            "v_proj.weight": book.W_value.weight,
            "o_proj.weight": book.out_proj.weight,
            "o_proj.bias": book.out_proj.bias,
        }
    )
    x = torch.randn(3, 10, d_out)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), book(x), atol=1e-6, rtol=1e-5)


def _llama_like(cls, config_cls, *, num_heads, num_kv_heads, head_dim, hidden, bias, **extra):
    config = config_cls(
        hidden_size=hidden,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        attention_bias=bias,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **extra,
    )
    config._attn_implementation = "eager"
    return config, cls(config, layer_idx=0).eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "family,num_heads,num_kv_heads,head_dim,hidden,bias",
    [
        ("llama", 4, 2, 8, 32, False),
        ("llama", 6, 1, 4, 18, True),  # multi-query; head size 4, not C / H = 3
        ("llama", 3, 3, 8, 24, False),
        ("qwen3", 4, 2, 16, 48, False),  # q/k RMSNorm
    ],
)
def test_matches_transformers_eager_attention(backend, family, num_heads, num_kv_heads, head_dim, hidden, bias):
    torch.manual_seed(num_heads * 7 + num_kv_heads)
    if family == "llama":
        config, ref = _llama_like(
            LlamaAttention, LlamaConfig, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, hidden=hidden, bias=bias,
        )
    else:
        config, ref = _llama_like(
            Qwen3Attention, Qwen3Config, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, hidden=hidden, bias=bias, rms_norm_eps=1e-6,
        )
        with torch.no_grad():  # non-trivial norm weights, or the norms' weights go untested
            ref.q_norm.weight.uniform_(0.5, 1.5)
            ref.k_norm.weight.uniform_(0.5, 1.5)
    ours = GroupedQueryAttention(
        hidden, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_bias=bias,
        out_bias=bias, qk_norm=family == "qwen3", backend=backend,
    ).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected

    b, t = 2, 9
    x = torch.randn(b, t, hidden)
    positions = torch.arange(t).expand(b, t)  # (B, T)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, positions)
    cos, sin = RotaryEmbedding(head_dim, theta=10000.0)(positions)
    real = torch.ones(b, t, dtype=torch.bool)
    real[1, :2] = False  # left padding on the second sequence
    allowed = causal_mask(t)[None, None] & padding_mask(real)  # (B, 1, T, T)
    # Rows whose keys are all padding (the padded queries) differ by convention; compare the rest.
    additive = torch.zeros(b, 1, t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected, _ = ref(x, position_embeddings=(hf_cos, hf_sin), attention_mask=additive)
        got = ours(x, cos=cos, sin=sin, mask=padding_mask(real), is_causal=True)
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1, 2:], expected[1, 2:], atol=1e-6, rtol=1e-5)


def test_query_heads_of_names_the_heads_that_read_a_kv_head():
    torch.manual_seed(0)
    h, h_kv, d = 6, 2, 4
    layer = GroupedQueryAttention(h * d, h, num_kv_heads=h_kv).eval()
    with torch.no_grad():
        layer.o_proj.weight.copy_(torch.eye(h * d))  # output columns = per-head contexts
    x = torch.randn(1, 5, h * d)
    with torch.no_grad():
        before = layer(x).view(1, 5, h, d)
        for kv_head in range(h_kv):
            rows = slice(kv_head * d, (kv_head + 1) * d)
            saved = layer.v_proj.weight[rows].clone()
            layer.v_proj.weight[rows] += 1.0  # change only this key/value head's values
            after = layer(x).view(1, 5, h, d)
            layer.v_proj.weight[rows] = saved
            changed = [i for i in range(h) if not torch.equal(before[:, :, i], after[:, :, i])]
            assert changed == layer.query_heads_of(kv_head)


def test_dropout_and_backend_choice_only_change_what_they_should():
    torch.manual_seed(0)
    layer = GroupedQueryAttention(16, 4, num_kv_heads=2, dropout=0.5)
    x = torch.randn(2, 6, 16)
    layer.eval()
    with torch.no_grad():
        fused = layer(x)
        layer.backend = "explicit"
        torch.testing.assert_close(layer(x), fused, atol=1e-6, rtol=1e-5)
        layer.train()
        assert not torch.allclose(layer(x), fused)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(emb_dim=30, num_heads=4), r"emb_dim \(30\).*num_heads \(4\)"),
        (dict(emb_dim=32, num_heads=4, num_kv_heads=3), r"num_heads \(4\).*num_kv_heads \(3\)"),
        (dict(emb_dim=32, num_heads=4, num_kv_heads=0), r"num_kv_heads \(0\)"),
        (dict(emb_dim=32, num_heads=0, head_dim=8), r"num_heads \(0\)"),
        (dict(emb_dim=32, num_heads=4, backend="flash"), r"'flash'.*explicit, fused"),
    ],
)
def test_bad_constructor_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupedQueryAttention(**kwargs)


def test_bad_input_shape_raises_value_error():
    layer = GroupedQueryAttention(16, 4)
    with pytest.raises(ValueError, match=r"\(batch, tokens, 16\).*\(2, 5, 12\)"):
        layer(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"\(5, 16\)"):
        layer(torch.randn(5, 16))
