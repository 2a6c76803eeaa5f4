"""The quantized KV cache against its definition and against full-precision attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention.caches.kv_cache import CacheSpec, StaticKVCache
from qkv.attention.caches.quantize import dequantize, pack, quantize, unpack
from qkv.attention.caches.quantized_cache import QuantizedKVCache
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig


def spec(capacity: int = 128, heads: int = 2, dim: int = 16) -> CacheSpec:
    return CacheSpec(batch_size=2, num_kv_heads=heads, capacity=capacity, head_dim=dim, value_dim=dim,
                     dtype=torch.float32, device=torch.device("cpu"))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 10_000), scale=st.floats(0.01, 100.0))
def test_dequantization_error_is_within_half_a_step(bits: int, seed: int, scale: float) -> None:
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed)) * scale
    codes, step, zero = quantize(x, bits, dim=1)
    error = (dequantize(codes, step, zero) - x).abs()
    bound = step / 2 + 1e-5 * x.abs().amax(dim=1, keepdim=True) + 1e-6
    assert (error <= bound).all()
    assert int(codes.max()) <= (1 << bits) - 1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trips_and_really_packs(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (2, 3, 16), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (2, 3, 16 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def feed(cache, k: torch.Tensor, v: torch.Tensor, chunks: list[int]):
    start, out = 0, None
    for size in chunks:
        pos = torch.arange(start, start + size)
        out = cache.update(k[:, :, start:start + size], v[:, :, start:start + size], pos)
        start += size
    return out


@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4])
def test_held_keys_are_within_their_bounds_and_tail_is_exact(bits: int, key_axis: str) -> None:
    torch.manual_seed(0)
    s = spec()
    k, v = torch.randn(2, 2, 100, 16), torch.randn(2, 2, 100, 16)
    cache = QuantizedKVCache(s, bits=bits, group_size=8, residual=16, sinks=4, key_axis=key_axis)
    keys, values, visible = feed(cache, k, v, [37, 1, 1, 5, 55])
    # A prompt's call answers with the group slots in use: sinks, 72 quantized, the tail.
    assert int(cache.quantized) == 4 + 72  # 95 tokens past the sinks, the 16 newest kept
    assert keys.shape == (2, 2, 4 + 72 + 24, 16) and int(visible[0, 0, -1].sum()) == 99
    keys, values, visible = cache.update(k[:, :, 99:], v[:, :, 99:], torch.tensor([99]))
    # A decode step has one layout at every length: sinks, every group slot, the tail.
    assert keys.shape == (2, 2, 4 + 128 + 24, 16) and visible.shape[-1] == keys.shape[2]
    assert int(visible.sum()) == 100 and cache.length == 100  # it sees every position
    keys, values = cache.contents()  # the held positions, in order
    assert keys.shape == (2, 2, 100, 16)
    quantized = int(cache.quantized)
    # 100 - 4 sinks = 96 tokens; groups are quantized only once older than the 16 newest.
    assert quantized == 4 + ((96 - 16) // 8) * 8
    assert torch.equal(keys[:, :, :4], k[:, :, :4]) and torch.equal(keys[:, :, quantized:], k[:, :, quantized:])
    assert torch.equal(values[:, :, quantized:], v[:, :, quantized:])
    levels = (1 << bits) - 1
    span = k[:, :, 4:quantized]
    if key_axis == "channel":
        grouped = span.reshape(2, 2, -1, 8, 16)  # per channel within a group of 8 tokens
        step = (grouped.amax(3, keepdim=True) - grouped.amin(3, keepdim=True)) / levels
        step = step.expand_as(grouped).reshape(span.shape)
    else:
        grouped = span.reshape(2, 2, -1, 1, 16)
        step = ((grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / levels).expand_as(grouped)
        step = step.reshape(span.shape)
    assert ((keys[:, :, 4:quantized] - span).abs() <= step / 2 + 1e-5).all()
    assert ((values[:, :, 4:quantized] - v[:, :, 4:quantized]).abs()
            <= (v[:, :, 4:quantized].amax(-1, keepdim=True) - v[:, :, 4:quantized].amin(-1, keepdim=True))
            / levels / 2 + 1e-5).all()


def test_nbytes_counts_packed_codes_and_statistics() -> None:
    s = CacheSpec(batch_size=1, num_kv_heads=1, capacity=4096, head_dim=64, value_dim=64,
                  dtype=torch.bfloat16, device=torch.device("cpu"))
    full = StaticKVCache(s).nbytes
    for bits, at_least in ((4, 3.5), (2, 6.0)):
        cache = QuantizedKVCache(s, bits=bits, group_size=64, residual=64, channel_group=64, sinks=4)
        slots = 4096 - 4  # rounded up to whole groups of 64 tokens
        slots = -(-slots // 64) * 64
        expected = (2 * slots * 64 * bits // 8  # packed codes, keys and values
                    + 2 * (slots // 64) * 64 * 2  # key scale + zero: per channel per group
                    + 2 * slots * 1 * 2  # value scale + zero: per token per 64 channels
                    + 2 * 128 * 64 * 2  # full-precision tail (residual + a group)
                    + 2 * 4 * 64 * 2)  # exact sinks
        assert cache.nbytes == expected
        # Each further token costs codes + statistics only (the tail and sinks are fixed).
        bigger = QuantizedKVCache(s.__class__(**{**s.__dict__, "capacity": 8192}), bits=bits,
                                  group_size=64, residual=64, channel_group=64, sinks=4)
        per_token = (bigger.nbytes - cache.nbytes) / 4096
        assert 2 * 64 * 2 / per_token >= at_least  # against bfloat16 keys + values


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attention_backend="explicit")
    return LlamaForCausalLM(cfg).eval()


def decode_logits(model: LlamaForCausalLM, ids: torch.Tensor, kind, prompt: int) -> torch.Tensor:
    caches = [kind(spec) for spec in model.cache_specs(1, 128)]
    outs = [model(ids[:, :prompt], caches=caches)]
    for i in range(prompt, ids.shape[1]):
        outs.append(model(ids[:, i:i + 1], caches=caches))
    return torch.cat(outs, dim=1)


@torch.no_grad()
def test_a_residual_covering_everything_gives_the_full_cache_exactly() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 60))
    full = decode_logits(model, ids, StaticKVCache, 20)
    same = decode_logits(model, ids, QuantizedKVCache.kind(bits=2, residual=128), 20)
    assert torch.allclose(full, same, atol=1e-5)


@torch.no_grad()
def test_quantized_attention_is_close_to_full_precision_and_bits_order_the_error() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 100))
    full = decode_logits(model, ids, StaticKVCache, 40).log_softmax(-1)
    errors = {}
    for bits in (8, 4, 2):
        out = decode_logits(model, ids, QuantizedKVCache.kind(bits=bits, group_size=16, residual=16), 40)
        errors[bits] = (out.log_softmax(-1) - full).abs().max().item()
    assert errors[8] < errors[4] < errors[2] < 1.0
    assert errors[8] < 1e-2


def test_bad_options_and_rewinds_are_refused() -> None:
    with pytest.raises(ValueError, match="2, 4 or 8 bits"):
        QuantizedKVCache(spec(), bits=3)
    cache = QuantizedKVCache(spec(), bits=4, group_size=8, residual=8)
    k = torch.randn(2, 2, 40, 16)
    feed(cache, k, k, [40])
    with pytest.raises(NotImplementedError):
        cache.truncate(3)
    cache.truncate(38)
    assert cache.length == 38
    cache.reset()
    assert cache.length == 0


@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_one_token_steps_store_what_a_whole_prompt_stores(key_axis: str) -> None:
    """Decode steps (tensor operations only: a full group is quantized through torch.where)
    and one long call (counters read into Python) leave the same codes, statistics and tail."""
    torch.manual_seed(1)
    k, v = torch.randn(2, 2, 100, 16), torch.randn(2, 2, 100, 16)
    stepped = QuantizedKVCache(spec(), bits=4, group_size=8, residual=16, sinks=4, key_axis=key_axis)
    whole = QuantizedKVCache(spec(), bits=4, group_size=8, residual=16, sinks=4, key_axis=key_axis)
    feed(stepped, k, v, [1] * 100)
    feed(whole, k, v, [100])
    assert int(stepped.quantized) == int(whole.quantized) == 84
    for (a, b) in zip(stepped.contents(), whole.contents()):
        assert torch.equal(a, b)
