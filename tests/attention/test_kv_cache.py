"""The KV cache: in-place writes, reset, size, overflow, and cached == uncached decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import GroupedQueryAttention, KVCache, RotaryEmbedding


def test_update_writes_in_place_and_returns_everything_so_far():
    cache = KVCache(2, 3, 10, 4)
    k_buffer, v_buffer = cache.k_cache.data_ptr(), cache.v_cache.data_ptr()
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    keys, values = cache.update(k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1) and cache.length == 4
    keys, values = cache.update(k2, v2)
    assert torch.equal(keys, torch.cat((k1, k2), dim=2))
    assert torch.equal(values, torch.cat((v1, v2), dim=2))
    assert cache.length == 5 and cache.capacity == 10
    # Written into the preallocated buffers, returned as views of them: nothing reallocated.
    assert cache.k_cache.data_ptr() == k_buffer and cache.v_cache.data_ptr() == v_buffer
    assert keys.data_ptr() == k_buffer and values.data_ptr() == v_buffer
    assert torch.equal(cache.k_cache[:, :, :5], keys)


def test_reset_starts_over():
    cache = KVCache(1, 1, 4, 2)
    cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    cache.reset()
    assert cache.length == 0
    k = torch.full((1, 1, 2, 2), 7.0)
    keys, values = cache.update(k, 2 * k)
    assert torch.equal(keys, k) and torch.equal(values, 2 * k) and cache.length == 2


@settings(max_examples=20, deadline=None)
@given(
    b=st.integers(1, 4),
    h=st.integers(1, 8),
    s=st.integers(1, 64),
    d=st.integers(1, 32),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_nbytes(b, h, s, d, dtype):
    cache = KVCache(b, h, s, d, dtype=dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert cache.nbytes == 2 * b * h * s * d * itemsize
    assert cache.k_cache.shape == cache.v_cache.shape == (b, h, s, d)


def test_buffers_stay_out_of_the_state_dict():
    assert KVCache(1, 2, 8, 4).state_dict() == {}


def test_writing_past_capacity_raises_clear_value_error():
    cache = KVCache(1, 2, 5, 4)
    cache.update(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"holds 5 tokens, 4 are cached and 2 more.*larger cache"):
        cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert cache.length == 4  # the failed write changed nothing


def test_wrong_batch_or_heads_raise_value_error():
    cache = KVCache(2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"batch 2 x 3 heads.*\(1, 3, 1, 4\)"):
        cache.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    with pytest.raises(ValueError, match=r"heads of size 4.*keys of shape \(2, 3, 1, 3\)"):
        cache.update(torch.randn(2, 3, 1, 3), torch.randn(2, 3, 1, 3))
    with pytest.raises(ValueError, match=r"values of shape \(2, 3, 2, 4\)"):
        cache.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 2, 4))
    with pytest.raises(ValueError, match=r"keys of shape \(3, 1, 4\)"):
        cache.update(torch.randn(3, 1, 4), torch.randn(3, 1, 4))
    assert cache.length == 0
    with pytest.raises(ValueError, match="positive"):
        KVCache(0, 3, 5, 4)


@pytest.mark.parametrize("backend", ["explicit", "fused"])
@pytest.mark.parametrize("num_kv_heads", [1, 4])
@pytest.mark.parametrize("prefill", [1, 3])
def test_cached_decoding_equals_full_causal_forward(backend, num_kv_heads, prefill):
    torch.manual_seed(num_kv_heads * 10 + prefill)
    b, t, c = 2, 7, 32
    layer = GroupedQueryAttention(c, 4, num_kv_heads=num_kv_heads, backend=backend).eval()
    rope = RotaryEmbedding(layer.head_dim)
    x = torch.randn(b, t, c)
    with torch.no_grad():
        cos, sin = rope(torch.arange(t))
        full = layer(x, cos=cos, sin=sin)  # (B, T, C), causal
        cache = layer.setup_cache(b, t + 2, dtype=x.dtype, device=x.device)
        pieces = [layer(x[:, :prefill], cos=cos[:prefill], sin=sin[:prefill])]
        for pos in range(prefill, t):  # one token at a time, its position's rotation
            pieces.append(layer(x[:, pos : pos + 1], cos=cos[pos : pos + 1], sin=sin[pos : pos + 1]))
    assert cache.length == t
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-6, rtol=1e-5)
