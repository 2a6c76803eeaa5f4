"""The KV cache interface and its static kind: writes at positions carried as tensors,
static shapes, the mask derived from positions, and cached attention == full attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import GroupedQueryAttention, RotaryEmbedding
from qkv.attention.caches.kv_cache import CacheSpec, KVCache, StaticKVCache, visible_keys


def spec(b=2, h=3, capacity=10, d=4, dtype=torch.float32) -> CacheSpec:
    return CacheSpec(b, h, capacity, d, d, dtype, torch.device("cpu"))


def test_update_writes_at_positions_and_keeps_shapes_static():
    cache = StaticKVCache(spec())
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    keys, values, visible = cache.update(k1, v1, torch.arange(4))
    assert keys.shape == values.shape == (2, 3, 10, 4)  # the whole capacity, every time
    assert torch.equal(keys[:, :, :4], k1) and torch.equal(values[:, :, :4], v1)
    assert cache.length == 4 and visible.shape == (1, 1, 4, 10)
    # query i (position i) sees keys 0..i and nothing beyond
    assert torch.equal(visible[0, 0], torch.arange(10)[None] <= torch.arange(4)[:, None])
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    keys, _, visible = cache.update(k2, v2, torch.tensor([4]))
    assert keys.shape == (2, 3, 10, 4) and torch.equal(keys[:, :, 4:5], k2)
    assert cache.length == 5 and visible[0, 0, 0].tolist() == [True] * 5 + [False] * 5
    keys2, values2 = cache.contents()
    assert torch.equal(keys2, keys[:, :, :5]) and values2.shape == (2, 3, 5, 4)


def test_rows_at_their_own_positions():
    cache = StaticKVCache(spec(b=2))
    cache.update(torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4), torch.arange(3))
    k = torch.randn(2, 3, 1, 4)
    keys, _, visible = cache.update(k, k, torch.tensor([[1], [3]]))  # row 0 rewinds, row 1 goes on
    assert torch.equal(keys[0, :, 1], k[0, :, 0]) and torch.equal(keys[1, :, 3], k[1, :, 0])
    assert visible.shape == (2, 1, 1, 10)
    assert visible[0, 0, 0].sum() == 2 and visible[1, 0, 0].sum() == 4


def test_reset_truncate_and_no_state_dict():
    cache = StaticKVCache(spec())
    cache.update(torch.ones(2, 3, 6, 4), torch.ones(2, 3, 6, 4), torch.arange(6))
    cache.truncate(2)
    assert cache.length == 2
    cache.reset()
    assert cache.length == 0
    assert cache.state_dict() == {}
    assert cache.nbytes == 2 * 2 * 3 * 10 * 4 * 4


@pytest.mark.parametrize("bad", [
    dict(k=torch.zeros(2, 3, 1, 5)),  # wrong head size
    dict(k=torch.zeros(1, 3, 1, 4)),  # wrong batch
    dict(positions=torch.tensor([0, 1])),  # one position per new token
    dict(positions=torch.tensor([0.0])),  # integers only
])
def test_bad_writes_name_the_shapes(bad):
    cache = StaticKVCache(spec())
    args = dict(k=torch.zeros(2, 3, 1, 4), v=torch.zeros(2, 3, 1, 4), positions=torch.tensor([0]))
    args.update(bad)
    with pytest.raises(ValueError, match="KV cache|positions"):
        cache.update(args["k"], args["v"] if "k" not in bad else args["k"], args["positions"])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity=0"):
        spec(capacity=0)


def test_the_interface_is_abstract():
    with pytest.raises(TypeError):
        KVCache(spec())  # type: ignore[abstract]


@settings(max_examples=40, deadline=None)
@given(positions=st.lists(st.integers(0, 12), min_size=1, max_size=5), keys=st.integers(1, 13))
def test_visible_keys_is_key_position_at_most_query_position(positions, keys):
    mask = visible_keys(torch.arange(keys), torch.tensor(positions))
    for i, p in enumerate(positions):
        for j in range(keys):
            assert bool(mask[0, 0, i, j]) == (j <= p)


class CountingCache(StaticKVCache):
    """Another kind of cache, plugged in without touching the layer: counts its writes."""

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.writes = 0

    def update(self, k, v, positions):
        self.writes += 1
        return super().update(k, v, positions)


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
        cache = CountingCache(layer.cache_spec(b, t + 2, dtype=x.dtype, device=x.device))
        pieces = [layer(x[:, :prefill], cos=cos[:prefill], sin=sin[:prefill], positions=torch.arange(prefill),
                        cache=cache)]
        for pos in range(prefill, t):  # one token at a time, its position's rotation
            pieces.append(layer(x[:, pos : pos + 1], cos=cos[pos : pos + 1], sin=sin[pos : pos + 1],
                                positions=torch.tensor([pos]), cache=cache))
    assert cache.length == t and cache.writes == 1 + t - prefill
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-6, rtol=1e-5)
