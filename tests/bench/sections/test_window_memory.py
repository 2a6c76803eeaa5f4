"""kv-window: the bytes it reports are the bytes the caches hold, the ring's stay flat past
its window and the full cache's grow with the session it was sized for."""

from __future__ import annotations

import torch

from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.attention.caches.window_cache import WindowKVCache
from qkv.bench.sections.window_memory import WindowSizes, filled_cache, held_bytes, window_memory, window_memory_table

SIZES = WindowSizes((128, 512, 1024, 2048), 64, 2, 8, 3, 1, chunk=100)


def test_window_bytes_stay_flat_past_the_window_while_the_full_cache_grows() -> None:
    facts = window_memory(SIZES)
    rows = facts["by context length"]
    assert facts["window bytes flat past the window"] and facts["full bytes grow with the context"]
    window = {row["window layer bytes"] for row in rows.values()}
    assert len(window) == 1
    full = [row["full layer bytes"] for row in rows.values()]
    # A full cache holds at least the keys and values of every position, in bfloat16.
    assert all(size >= int(n) * 2 * 2 * 8 * 2 for size, n in zip(full, rows))
    assert full == sorted(full) and full[0] < full[-1]
    assert window.copy().pop() < 2 * (2 * 2 * 8 * 2 * 65)  # about W + 1 slots, whatever N
    assert rows["2048"]["model bytes, local layers windowed"] == 3 * window.pop() + full[-1]
    assert "| 2048 |" in window_memory_table(facts)


def test_held_bytes_count_every_buffer_of_the_cache() -> None:
    cache = filled_cache(WindowKVCache.kind(window=64), SIZES, 300)
    assert held_bytes(cache) == cache.nbytes
    assert cache.length == 300 and cache.contents()[0].shape[2] == 64
    keys, _ = cache.contents()
    assert keys.dtype == torch.bfloat16
