"""The sliding-window cache against explicit attention over the whole sequence with a
sliding-window mask: prompts shorter and longer than the window, decode steps past it,
rows of different lengths, any chunking (hypothesis), and its memory flat past the window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import GroupedQueryAttention, RotaryEmbedding
from qkv.attention.kernels import explicit_attention
from qkv.attention.caches.kv_cache import CacheSpec, SlotKVCache, SlotSelection, StaticKVCache
from qkv.attention.caches.quantized_cache import QuantizedKVCache
from qkv.attention.caches.window_cache import WindowKVCache, cache_kind_for, cache_kinds_for

H, H_KV, D = 4, 2, 8


def spec(batch: int = 1, capacity: int = 256) -> CacheSpec:
    return CacheSpec(batch_size=batch, num_kv_heads=H_KV, capacity=capacity, head_dim=D, value_dim=D,
                     dtype=torch.float32, device=torch.device("cpu"))


def reference_mask(n: int, window: int) -> torch.Tensor:
    """(n, n) the query at p sees the keys at p - window < k <= p."""
    p = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    return (k <= p) & (k > p - window)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Explicit attention over the full sequence with a sliding-window mask."""
    context, _ = explicit_attention(q, k, v, mask=reference_mask(q.shape[2], window))
    return context


def run_chunks(cache: WindowKVCache, q, k, v, chunks: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for size in chunks:
        pos = torch.arange(start, start + size)
        keys, values, visible = cache.update(k[:, :, pos], v[:, :, pos], pos)
        context, _ = explicit_attention(q[:, :, pos], keys, values, mask=visible)
        outs.append(context)
        start += size
    return torch.cat(outs, dim=2)


def qkv(batch: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, H, n, D, generator=g), torch.randn(batch, H_KV, n, D, generator=g),
            torch.randn(batch, H_KV, n, D, generator=g))


@pytest.mark.parametrize("chunks", [
    [5] + [1] * 20,          # a prompt shorter than the window, decode steps past it
    [20] + [1] * 6,          # a prompt longer than the window
    [7, 7, 7, 7],            # chunks that each fill most of the ring
    [1] * 25,                # token by token
    [3, 30, 1, 1],           # a chunk of several windows in the middle
], ids=["short-prompt", "long-prompt", "chunks", "tokens", "long-chunk"])
def test_every_query_sees_its_own_last_window_keys(chunks: list[int]) -> None:
    window, n = 8, sum(chunks)
    q, k, v = qkv(2, n)
    cache = WindowKVCache(spec(batch=2), window=window)
    torch.testing.assert_close(run_chunks(cache, q, k, v, chunks), reference(q, k, v, window))
    assert cache.length == n
    held_k, held_v = cache.contents()
    assert torch.equal(held_k, k[:, :, n - window:]) and torch.equal(held_v, v[:, :, n - window:])


@settings(max_examples=30, deadline=None)
@given(window=st.integers(1, 9), chunks=st.lists(st.integers(1, 12), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_any_window_and_chunking_matches_the_reference(window: int, chunks: list[int], seed: int) -> None:
    n = sum(chunks)
    q, k, v = qkv(1, n, seed)
    cache = WindowKVCache(spec(), window=window)
    torch.testing.assert_close(run_chunks(cache, q, k, v, chunks), reference(q, k, v, window))


def test_decode_shapes_stay_fixed_past_the_window() -> None:
    window = 6
    q, k, v = qkv(1, 30)
    cache = WindowKVCache(spec(), window=window)
    cache.update(k[:, :, :4], v[:, :, :4], torch.arange(4))
    shapes = set()
    for p in range(4, 30):
        keys, values, visible = cache.update(k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor([p]))
        shapes.add((keys.shape, values.shape, visible.shape))
    # A decode step reads the ring in place: W keys, whatever the length.
    assert shapes == {(torch.Size([1, H_KV, window, D]),) * 2 + (torch.Size([1, 1, 1, window]),)}
    assert keys.data_ptr() == cache.k_cache.data_ptr()


@settings(max_examples=12, deadline=None)
@given(window=st.integers(1, 7), lengths=st.lists(st.integers(1, 15), min_size=2, max_size=3),
       steps=st.integers(0, 10), seed=st.integers(0, 2**16))
def test_rows_of_different_lengths_each_match_their_own_sequence(
        window: int, lengths: list[int], steps: int, seed: int) -> None:
    """A padded prompt (padding marked by position -1), then decode steps at each row's own
    position: every row equals the reference over its own tokens."""
    b, t = len(lengths), max(lengths)
    n = t + steps
    q, k, v = qkv(b, n, seed)
    cache = WindowKVCache(spec(batch=b), window=window)
    pos = torch.arange(t).expand(b, t).clone()
    for row, length in enumerate(lengths):
        pos[row, length:] = -1  # padding: neither stored nor seen
    keys, values, visible = cache.update(k[:, :, :t], v[:, :, :t], pos)
    prompt_out, _ = explicit_attention(q[:, :, :t], keys, values, mask=visible)
    outs = [[prompt_out[row:row + 1, :, :length]] for row, length in enumerate(lengths)]
    for step in range(steps):
        at = torch.tensor([[length + step] for length in lengths])  # (B, 1)
        new = torch.tensor(lengths) + step  # (B,) where each row's token comes from
        rows = torch.arange(b)
        k_new, v_new = k[rows, :, new][:, :, None], v[rows, :, new][:, :, None]  # (B, H_kv, 1, D)
        keys, values, visible = cache.update(k_new, v_new, at)
        out, _ = explicit_attention(q[rows, :, new][:, :, None], keys, values, mask=visible)
        for row in range(b):
            outs[row].append(out[row:row + 1])
    assert cache.lengths.tolist() == [length + steps for length in lengths]
    for row, length in enumerate(lengths):
        seq = list(range(length)) + list(range(length, length + steps))
        own = [slice(row, row + 1), slice(None), seq]
        expected = reference(q[tuple(own)], k[tuple(own)], v[tuple(own)], window)
        torch.testing.assert_close(torch.cat(outs[row], dim=2), expected)


def test_padding_written_past_a_row_is_replaced_by_its_next_tokens() -> None:
    """The full cache's convention: a batch prompt with padding at the end at true positions;
    each row's decode steps then start at its own length and hide what lies beyond."""
    window, lengths, t = 5, [4, 2], 4
    q, k, v = qkv(2, 10)
    cache = WindowKVCache(spec(batch=2), window=window)
    cache.update(k[:, :, :t], v[:, :, :t], torch.arange(t))
    for step in range(4):
        at = torch.tensor([[lengths[0] + step], [lengths[1] + step]])
        keys, values, visible = cache.update(k[:, :, t + step:t + step + 1].expand(2, -1, -1, -1).clone(),
                                             v[:, :, t + step:t + step + 1].expand(2, -1, -1, -1).clone(), at)
    # Row 1 now holds positions 0, 1 (its prompt) and 2..5 (the decoded keys k[4..7]).
    row_keys = torch.cat([k[1:2, :, :2], k[1:2, :, 4:8]], dim=2)[:, :, -window:]
    held, _ = cache.contents()
    assert torch.equal(held[1:2], row_keys)
    assert cache.lengths.tolist() == [8, 6]


@pytest.mark.parametrize("backend", ["explicit", "fused"])
def test_a_grouped_query_layer_through_the_cache_equals_its_windowed_full_sequence(backend: str) -> None:
    """A GroupedQueryAttention layer with RoPE fed a prompt longer than the window, then
    decode steps, equals the same layer over the whole sequence with a sliding-window mask."""
    torch.manual_seed(0)
    window, n, c = 6, 19, 32
    layer = GroupedQueryAttention(c, H, num_kv_heads=H_KV, head_dim=D, backend=backend).eval()
    rotary = RotaryEmbedding(D)
    x = torch.randn(2, n, c)
    cos, sin = rotary(torch.arange(n))
    with torch.no_grad():
        expected = layer(x, cos=cos, sin=sin, mask=reference_mask(n, window), is_causal=False)
        cache = WindowKVCache.kind(window=window)(layer.cache_spec(2, 64, dtype=torch.float32,
                                                                   device=torch.device("cpu")))
        outs, start = [], 0
        for size in [9, 1, 1, 5, 1, 1, 1]:
            pos = torch.arange(start, start + size)
            cos_p, sin_p = rotary(pos)
            outs.append(layer(x[:, start:start + size], cos=cos_p, sin=sin_p, positions=pos, cache=cache))
            start += size
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, atol=1e-5, rtol=1e-5)


def test_nbytes_stay_flat_past_the_window_while_a_full_cache_grows() -> None:
    window = 64
    sizes = []
    for capacity in (256, 1024, 4096):
        cache = WindowKVCache(spec(capacity=capacity), window=window)
        k = torch.randn(1, H_KV, capacity, D)
        cache.update(k, k, torch.arange(capacity))
        sizes.append((cache.nbytes, StaticKVCache(spec(capacity=capacity)).nbytes))
    window_bytes, full_bytes = zip(*sizes)
    assert len(set(window_bytes)) == 1
    assert full_bytes[0] < full_bytes[1] < full_bytes[2]
    # The ring: W slots plus the scratch slot, of keys and values.
    assert window_bytes[0] < 2 * H_KV * (window + 1) * D * 4 + 2 * 8 * (window + 1) + 64
    assert window_bytes[0] >= 2 * H_KV * (window + 1) * D * 4


def test_a_session_shorter_than_the_window_holds_only_its_capacity() -> None:
    cache = WindowKVCache(spec(capacity=16), window=512)
    assert cache.capacity == 16 and cache.max_position == 16
    assert WindowKVCache(spec(capacity=1024), window=512).max_position > 10**9


def test_truncate_inside_the_window_is_exact_and_past_evicted_keys_is_refused() -> None:
    window = 6
    q, k, v = qkv(1, 20)
    cache = WindowKVCache(spec(), window=window)
    cache.update(k[:, :, :5], v[:, :, :5], torch.arange(5))
    cache.truncate(3)  # nothing was evicted: positions 0..2 stay
    assert cache.length == 3
    out = run_chunks_from(cache, q, k, v, 3, 20)
    torch.testing.assert_close(out, reference(q, k, v, window)[:, :, 3:])
    with pytest.raises(NotImplementedError, match="cannot rewind row 0 to position 15"):
        cache.truncate(15)  # position 15 sees 10..14; the ring holds 14..19 now
    cache.truncate(25)  # past the end: nothing to do
    assert cache.length == 20
    cache.reset()
    assert cache.length == 0 and cache.contents()[0].shape[2] == 0


def run_chunks_from(cache, q, k, v, start: int, end: int) -> torch.Tensor:
    outs = []
    for p in range(start, end):
        keys, values, visible = cache.update(k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor([p]))
        outs.append(explicit_attention(q[:, :, p:p + 1], keys, values, mask=visible)[0])
    return torch.cat(outs, dim=2)


def test_calls_on_some_rows_read_and_write_only_those_rows() -> None:
    """A server's slots: with `rows` set, a call carries those rows only."""
    window = 4
    q, k, v = qkv(1, 12)
    selection = SlotSelection()
    cache = WindowKVCache.kind(window=window, selection=selection)(spec(batch=3))
    selection.rows = torch.tensor([2])
    out = run_chunks(cache, q, k, v, [7, 1, 1, 1, 1, 1])
    torch.testing.assert_close(out, reference(q, k, v, window))
    assert cache.lengths.tolist() == [0, 0, 12]
    selection.rows = None
    cache.copy_row(2, 0, 12)
    assert torch.equal(cache.held_positions()[0], cache.held_positions()[2])
    with pytest.raises(NotImplementedError, match="no longer holds the window of position 9"):
        cache.copy_row(2, 1, 9)


def test_cache_kind_for_gives_local_layers_the_ring_and_global_layers_the_base_kind() -> None:
    kinds = cache_kinds_for([4, None, 4], SlotKVCache)
    assert kinds[1] is SlotKVCache
    local = kinds[0](spec())
    assert isinstance(local, WindowKVCache) and local.window == 4 and local.windowed
    assert isinstance(cache_kind_for(8, QuantizedKVCache.kind())(spec()), WindowKVCache)
    assert not getattr(StaticKVCache(spec()), "windowed", False)


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_bad_windows_are_refused(window) -> None:
    with pytest.raises(ValueError, match="window must be a positive integer"):
        WindowKVCache(spec(), window=window)


def test_wrong_shapes_are_refused_with_a_line_naming_them() -> None:
    cache = WindowKVCache(spec(), window=4)
    with pytest.raises(ValueError, match="this KV cache holds batch 1"):
        cache.update(torch.randn(2, H_KV, 1, D), torch.randn(2, H_KV, 1, D), torch.tensor([0]))
