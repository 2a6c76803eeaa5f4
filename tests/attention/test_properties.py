"""Invariants of attention, checked with hypothesis on random sizes and inputs:
weights form a distribution, causal attention never leaks, attention without a mask is
permutation-equivariant, fully masked rows are zeros, dropout acts only in training mode,
and the key projection learns (gets a gradient)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qkv.attention import GroupedQueryAttention, attention, explicit_attention
from qkv.book import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper

FAST = settings(max_examples=15, deadline=None)
backends = st.sampled_from(["explicit", "fused"])
seeds = st.integers(0, 2**31 - 1)


def _causal_layer(kind: str, c: int, t: int, dropout: float = 0.0) -> nn.Module:
    """A causal self-attention module taking (B, T, c): the book's or the grouped-query one."""
    if kind == "causal":
        return CausalAttention(c, 4, context_length=t, dropout=dropout)
    if kind == "wrapper":
        return MultiHeadAttentionWrapper(c, 4, context_length=t, dropout=dropout, num_heads=2)
    if kind == "book_mha":
        return MultiHeadAttention(c, 4, context_length=t, dropout=dropout, num_heads=2)
    return GroupedQueryAttention(c, 4, num_kv_heads=2, head_dim=3, dropout=dropout, backend=kind)


layer_kinds = st.sampled_from(["causal", "wrapper", "book_mha", "explicit", "fused"])


@FAST
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    t=st.integers(1, 8),
    s=st.integers(1, 8),
    d=st.integers(1, 16),
    masked=st.booleans(),
    seed=seeds,
)
def test_weights_are_nonnegative_and_rows_sum_to_one(lead, t, s, d, masked, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, t, d, generator=gen) * 3
    k = torch.randn(*lead, s, d, generator=gen) * 3
    v = torch.randn(*lead, s, d, generator=gen)
    mask = torch.rand(t, s, generator=gen) > 0.5 if masked else None
    _, weights = explicit_attention(q, k, v, mask=mask)
    assert weights.shape == (*lead, t, s)
    assert (weights >= 0).all()
    row_sums = weights.sum(dim=-1)
    expected = torch.ones_like(row_sums)
    if mask is not None:
        expected = expected * mask.any(dim=-1)  # rows with no visible key: all zeros
        assert (weights[..., ~mask] == 0).all()  # masked keys get no weight
    torch.testing.assert_close(row_sums, expected, atol=1e-6, rtol=0.0)


@FAST
@given(kind=layer_kinds, t=st.integers(2, 8), data=st.data(), seed=seeds)
def test_causal_attention_never_leaks(kind, t, data, seed):
    p = data.draw(st.integers(0, t - 2), label="last unchanged position")
    torch.manual_seed(seed)
    layer = _causal_layer(kind, 6, t).eval()
    x = torch.randn(2, t, 6)
    changed = x.clone()
    changed[:, p + 1 :] = torch.randn(2, t - p - 1, 6) * 5  # every later token changes
    with torch.no_grad():
        out, out_changed = layer(x), layer(changed)
    torch.testing.assert_close(out_changed[:, : p + 1], out[:, : p + 1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out_changed[:, p + 1 :], out[:, p + 1 :])  # later ones do change


@FAST
@given(backend=backends, t=st.integers(2, 8), h=st.integers(1, 3), seed=seeds)
def test_without_mask_permuting_tokens_permutes_outputs(backend, t, h, seed):
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(t, generator=gen)
    q, k, v = (torch.randn(2, h, t, 8, generator=gen) for _ in range(3))
    out = attention(q, k, v, backend=backend)
    # Permuting the queries permutes the outputs; permuting keys with their values changes nothing.
    out_perm = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], backend=backend)
    torch.testing.assert_close(out_perm, out[:, :, perm], atol=1e-6, rtol=1e-6)
    layer = GroupedQueryAttention(8, 2, num_kv_heads=1, backend=backend).eval()
    x = torch.randn(2, t, 8, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x[:, perm], is_causal=False), layer(x, is_causal=False)[:, perm], atol=1e-6, rtol=1e-6
        )


@FAST
@given(
    backend=backends,
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    t=st.integers(1, 6),
    s=st.integers(1, 6),
    seed=seeds,
)
def test_fully_masked_rows_give_zeros_never_nan(backend, dtype, t, s, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(2, 3, n, 8, generator=gen).to(dtype).requires_grad_() for n in (t, s, s)
    )
    mask = torch.rand(2, 1, t, s, generator=gen) > 0.5  # (B, 1, T, S)
    mask[0, :, 0] = False  # at least one row sees nothing
    out = attention(q, k, v, mask=mask, backend=backend)
    blind = ~mask.any(dim=-1)  # (B, 1, T)
    assert torch.isfinite(out).all()
    assert (out.float().permute(0, 2, 1, 3)[blind.squeeze(1)] == 0).all()
    out.float().sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    # Fully masked padding in every row of the second sequence: zeros, no NaN anywhere.
    empty = torch.zeros(2, 1, 1, s, dtype=torch.bool)
    assert (attention(q.detach(), k.detach(), v.detach(), mask=empty, backend=backend) == 0).all()


@FAST
@given(kind=layer_kinds, seed=seeds)
def test_dropout_acts_only_in_training_mode(kind, seed):
    torch.manual_seed(seed)
    t = 6
    layer = _causal_layer(kind, 5, t, dropout=0.5)
    plain = _causal_layer(kind, 5, t, dropout=0.0)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(3, t, 5)
    with torch.no_grad():
        layer.eval()
        first, second = layer(x), layer(x)
        assert torch.equal(first, second)
        torch.testing.assert_close(first, plain.eval()(x), atol=0.0, rtol=0.0)
        layer.train()
        assert not torch.allclose(layer(x), first)


@FAST
@given(kind=layer_kinds, seed=seeds)
def test_key_projection_gets_a_gradient(kind, seed):
    torch.manual_seed(seed)
    layer = _causal_layer(kind, 5, 6)
    x = torch.randn(2, 6, 5)
    out = layer(x)
    (out * torch.randn_like(out)).sum().backward()
    if kind == "wrapper":
        key_weights = [head.W_key.weight for head in layer.heads]
    elif isinstance(layer, GroupedQueryAttention):
        key_weights = [layer.k_proj.weight]
    else:
        key_weights = [layer.W_key.weight]
    for weight in key_weights:
        assert weight.grad is not None and torch.isfinite(weight.grad).all()
        assert weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["explicit", "fused"])
@pytest.mark.parametrize("per_query", [False, True], ids=["key_mask", "per_query_mask"])
@settings(max_examples=10, deadline=None)
@given(
    t=st.integers(2, 6),
    cached=st.integers(0, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=seeds,
)
def test_causal_with_padding_empty_rows_are_zeros_and_others_exact(backend, per_query, t, cached, dtype, seed):
    """Left padding hides every key an early query may see: that row is zeros, the rest
    equal softmax attention over the visible keys (computed here in float64)."""
    s = t + cached
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 2, n, 8, generator=gen).to(dtype) for n in (t, s, s))
    real = torch.rand(3, s, generator=gen) > 0.5  # (B, S)
    real[0, : cached + 1] = False  # the first query of sequence 0 sees only padding
    if per_query:  # a (B, 1, T, S) mask: the general path, not the key-only shortcut
        mask = (torch.rand(3, 1, t, s, generator=gen) > 0.3) & real[:, None, None, :]
    else:
        mask = real[:, None, None, :]  # (B, 1, 1, S)
    out = attention(q, k, v, mask=mask, is_causal=True, backend=backend)

    allowed = mask & (torch.arange(s)[None, :] <= torch.arange(t)[:, None] + cached)  # (B, 1, T, S)
    scores = (q.double() @ k.double().transpose(-2, -1)) / 8**0.5
    scores = scores.masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows: NaN -> 0
    expected = weights @ v.double()
    assert torch.isfinite(out).all()
    assert (out[0, :, 0] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["explicit", "fused"])
def test_left_padding_after_cached_keys(backend):
    """Keys 0-1 are padding, queries sit at positions 2, 3, 4 of 5: none of them is empty."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 1, 3, 4, generator=gen), torch.randn(1, 1, 5, 4, generator=gen), torch.randn(1, 1, 5, 4, generator=gen)
    real = torch.tensor([[False, False, True, True, True]])
    out = attention(q, k, v, mask=real[:, None, None, :], is_causal=True, backend=backend)
    sees = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sees)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0.0)
