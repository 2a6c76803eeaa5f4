"""The sink cache (StreamingLLM) against explicit attention over sinks + window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention.caches.kv_cache import CacheSpec, StaticKVCache
from qkv.attention.caches.sink_cache import SinkKVCache
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig


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
        caches = [kind(spec) for spec in model.cache_specs(1, 128)]
        outs = [model(ids[:, :10], caches=caches)] + [model(ids[:, i:i + 1], caches=caches)
                                                       for i in range(10, ids.shape[1])]
        return torch.cat(outs, dim=1)

    full = run(StaticKVCache)
    wide = run(SinkKVCache.kind(sinks=4, window=124))  # holds everything: exactly the full cache
    assert torch.allclose(full, wide, atol=1e-5)
    narrow = run(SinkKVCache.kind(sinks=2, window=30))  # 32 slots, 120 positions: runs on
    assert torch.allclose(full[:, :32], narrow[:, :32], atol=1e-5)
    assert not torch.allclose(full[:, 60:], narrow[:, 60:], atol=1e-3)


def streaming_reference(layer, rotary, x: torch.Tensor, chunks: list[int], sinks: int, window: int) -> torch.Tensor:
    """StreamingLLM's attention, written out: a chunk starting at true position p0 moves
    every position back by shift = max(0, p0 - sinks - window) before rotating, except
    the sinks', and each query p attends to keys k <= p with k < sinks or k > p - window."""
    from qkv.attention.rope import apply_rope

    b, n, _ = x.shape
    q, k, v = layer.project(x)
    q = q.view(b, n, layer.num_heads, layer.head_dim).transpose(1, 2)  # (B, H, N, D)
    k = k.view(b, n, layer.num_kv_heads, layer.head_dim).transpose(1, 2)  # (B, H_kv, N, D)
    v = v.view(b, n, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, H, N, D)
    outs, start = [], 0
    for size in chunks:
        shift = max(0, start - sinks - window)
        for p in range(start, start + size):
            keys = [j for j in range(p + 1) if j < sinks or j > p - window]
            key_pos = torch.tensor([j if j < sinks else j - shift for j in keys])
            cos_k, sin_k = rotary(key_pos)
            cos_q, sin_q = rotary(torch.tensor([p - shift]))
            qp = apply_rope(q[:, :, p:p + 1], cos_q, sin_q)  # (B, H, 1, D)
            kp = apply_rope(k[:, :, keys], cos_k, sin_k)  # (B, H, S, D)
            weights = (qp @ kp.transpose(-1, -2) / layer.head_dim ** 0.5).softmax(-1)
            outs.append(weights @ v[:, :, keys])  # (B, H, 1, D)
        start += size
    context = torch.cat(outs, dim=2).transpose(1, 2).reshape(b, n, -1)  # (B, N, H*D)
    return layer.o_proj(context)


@settings(max_examples=20, deadline=None)
@given(chunks=st.lists(st.integers(1, 12), min_size=1, max_size=8), sinks=st.integers(0, 4),
       window=st.integers(1, 12), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_with_rope_keys_are_rotated_by_their_place_in_the_cache(chunks: list[int], sinks: int, window: int,
                                                                seed: int) -> None:
    """Any chunking, any sinks and window: StreamingLLM's attention, written out."""
    from qkv.attention.grouped_query import GroupedQueryAttention
    from qkv.attention.rope import RotaryEmbedding

    torch.manual_seed(seed)
    layer = GroupedQueryAttention(32, 4, num_kv_heads=2, backend="explicit").eval()
    rotary = RotaryEmbedding(8, theta=100.0)
    cache = SinkKVCache.kind(sinks=sinks, window=window)(
        layer.cache_spec(1, 64, dtype=torch.float32, device="cpu", rotary=rotary))
    assert cache.rotates_keys
    x = torch.randn(1, sum(chunks), 32)
    outs, start = [], 0
    for size in chunks:
        pos = torch.arange(start, start + size)
        rope_pos = cache.rope_positions(pos)
        assert int(rope_pos.max()) < sinks + window + size  # never past what the cache spans
        cos, sin = rotary(rope_pos)
        outs.append(layer(x[:, start:start + size], cos=cos, sin=sin, positions=pos, cache=cache))
        start += size
    expected = streaming_reference(layer, rotary, x, chunks, sinks, window)
    assert torch.allclose(torch.cat(outs, dim=1), expected, atol=1e-5)


@torch.no_grad()
def test_a_rope_model_streams_past_its_context_length() -> None:
    from qkv.generation import generate

    model = tiny_llama()  # context length 256
    kind = SinkKVCache.kind(sinks=4, window=60)
    assert model.streams_past_context(kind)
    prompt = torch.randint(0, 97, (1, 150))  # prefilled in parts of one window
    out = generate(model, prompt, 300, kv_cache=kind)
    assert out.shape == (1, 450)
    # While everything fits in sinks + window, the sink cache is the full cache.
    short = torch.randint(0, 97, (1, 20))
    assert torch.equal(generate(model, short, 40, kv_cache=kind), generate(model, short, 40))


def test_learned_positions_crop_past_the_context_whatever_cache_is_asked() -> None:
    """A position table cannot slide, so a sink cache cannot take GPT-2 past its context:
    generation uses the asked-for cache while the tokens fit, then crops its window as the
    book's generate_text_simple does (qkv.generation.past_context), and says so."""
    from qkv.generation import generate
    from qkv.models.gpt2 import GPT2Decoder
    from qkv.models.configs.gpt2 import GPTConfig

    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=97, context_length=64, emb_dim=32, n_heads=4, n_layers=1)).eval()
    kind = SinkKVCache.kind(sinks=4, window=28)
    assert not model.streams_past_context(kind)
    prompt = torch.randint(0, 97, (1, 40))
    with pytest.warns(UserWarning, match="pass the context length .*the last 64 tokens"):
        sunk = generate(model, prompt, 40, kv_cache=kind)
    assert sunk.shape == (1, 80)
    assert torch.equal(sunk[:, :65], generate(model, prompt, 25, kv_cache=kind))  # 40 + 25 - 1 = 64 fit
    with torch.no_grad():
        for t in range(65, 80):  # each later token from the last 64, re-run (the book's crop)
            assert int(sunk[0, t]) == int(model(sunk[:, t - 64 : t])[0, -1].argmax())
