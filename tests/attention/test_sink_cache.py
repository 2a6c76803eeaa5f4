"""The sink cache (StreamingLLM) against explicit attention over sinks + window."""

from __future__ import annotations

import pytest
import torch

from qkv.attention.kv_cache import CacheSpec, StaticKVCache
from qkv.attention.sink_cache import SinkKVCache
from qkv.models.llama import LlamaForCausalLM
from qkv.models.llama_config import LlamaConfig


def spec() -> CacheSpec:
    return CacheSpec(batch_size=1, num_kv_heads=2, capacity=64, head_dim=8, value_dim=8,
                     dtype=torch.float32, device=torch.device("cpu"))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Explicit attention of each query p over keys {k < sinks} | {p - window < k <= p}."""
    n = k.shape[2]
    p = torch.arange(n)[:, None]
    kp = torch.arange(n)[None, :]
    allowed = (kp <= p) & ((kp < sinks) | (kp > p - window))
    scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def attend(q, keys, values, visible):
    scores = (q @ keys.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ values


@pytest.mark.parametrize("chunks", [[1] * 50, [13, 1, 1, 30, 5], [50], [3, 40, 7]])
def test_every_query_attends_over_its_sinks_and_window(chunks: list[int]) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 8) for _ in range(3))
    sinks, window = 3, 9
    cache = SinkKVCache(spec(), sinks=sinks, window=window)
    outs, start = [], 0
    for size in chunks:
        pos = torch.arange(start, start + size)
        keys, values, visible = cache.update(k[:, :, pos], v[:, :, pos], pos)
        outs.append(attend(q[:, :, pos], keys, values, visible))
        start += size
    assert torch.allclose(torch.cat(outs, dim=2), reference(q, k, v, sinks, window), atol=1e-5)
    assert cache.length == 50 and cache.capacity == 12
    held_k, _ = cache.contents()
    expected = list(range(sinks)) + list(range(50 - window, 50))
    assert torch.equal(held_k, k[:, :, expected])


def test_nbytes_is_fixed_by_sinks_and_window() -> None:
    cache = SinkKVCache(spec(), sinks=4, window=12)
    assert cache.nbytes == 2 * 16 * 2 * 8 * 4 + 16 * 8 + 8


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="window >= 1"):
        SinkKVCache(spec(), sinks=4, window=0)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attention_backend="explicit")
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_within_the_window_a_sink_cache_is_the_full_cache_and_it_runs_past_its_capacity() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 120))

    def run(kind) -> torch.Tensor:
        model.setup_cache(1, 128, kind=kind)
        try:
            outs = [model(ids[:, :10])] + [model(ids[:, i:i + 1]) for i in range(10, ids.shape[1])]
            return torch.cat(outs, dim=1)
        finally:
            model.remove_cache()

    full = run(StaticKVCache)
    wide = run(SinkKVCache.kind(sinks=4, window=124))  # holds everything: exactly the full cache
    assert torch.allclose(full, wide, atol=1e-5)
    narrow = run(SinkKVCache.kind(sinks=2, window=30))  # 32 slots, 120 positions: runs on
    assert torch.allclose(full[:, :32], narrow[:, :32], atol=1e-5)
    assert not torch.allclose(full[:, 60:], narrow[:, 60:], atol=1e-3)
