"""The KV cache interface and its static kind: writes at positions carried as tensors,
static shapes, the mask derived from positions, and cached attention == full attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import GroupedQueryAttention, RotaryEmbedding
from qkv.attention.caches.kv_cache import CacheSpec, KVCache, SlotKVCache, StaticKVCache, visible_keys


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


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3), st.integers(0, 20), st.integers(1, 12), st.sampled_from([None, 24, 40]),
       st.booleans())
def test_one_row_span_writes_what_the_indexed_write_does(row, first, t, limit, shared_positions):
    """A one-row call at consecutive positions takes slice copies and a view (the prefill
    path); the keys, values (contiguous copies), mask and lengths equal the indexed write's on the same call, and
    the other rows are untouched."""
    spec = CacheSpec(4, 2, 48, 3, 5, torch.float32, torch.device("cpu"))
    fast, reference = SlotKVCache(spec), SlotKVCache(spec)
    for cache in (fast, reference):
        torch.manual_seed(0)
        cache.k_cache.normal_()
        cache.v_cache.normal_()
        cache.selection.rows, cache.selection.limit = torch.tensor([row]), limit
    k, v = torch.randn(1, 2, t, 3), torch.randn(1, 2, t, 5)
    positions = torch.arange(first, first + t)  # (T,)
    if not shared_positions:
        positions = positions[None]  # (1, T)
    got = fast.update(k, v, positions)
    again = fast.update(k, v, positions)  # the mask is shared by the layers of a call, read only
    # the reference: the general indexed write, as for several rows
    end = spec.capacity if limit is None else limit
    rows = torch.tensor([row])
    p = positions.expand(1, t)
    reference.k_cache[rows[:, None], :, p] = k.transpose(1, 2)
    reference.v_cache[rows[:, None], :, p] = v.transpose(1, 2)
    reference.lengths[rows] = p.max(dim=1).values + 1
    want = (reference.k_cache[:, :, :end].index_select(0, rows), reference.v_cache[:, :, :end].index_select(0, rows),
            visible_keys(reference.slots[:end], p))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(again[2], want[2])
    assert torch.equal(fast.k_cache, reference.k_cache) and torch.equal(fast.v_cache, reference.v_cache)
    assert torch.equal(fast.lengths, reference.lengths)


def test_rows_at_scattered_positions_still_take_the_indexed_write():
    spec = CacheSpec(2, 1, 16, 2, 2, torch.float32, torch.device("cpu"))
    cache = SlotKVCache(spec)
    cache.selection.rows = torch.tensor([1])
    k = torch.randn(1, 1, 3, 2)
    keys, _, mask = cache.update(k, k, torch.tensor([[0, 5, 9]]))
    assert torch.equal(keys[0, 0, [0, 5, 9]], k[0, 0]) and int(cache.lengths[1]) == 10
    assert mask.shape == (1, 1, 3, 16) and torch.equal(mask[0, 0, 1], torch.arange(16) <= 5)
