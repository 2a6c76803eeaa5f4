"""The attention options the newer families need, each against a reference computed another
way: sliding windows (no cache, StaticKVCache, SlotKVCache), soft-capped scores, partial
rotary (transformers' Phi-3 function), q/k norm over all heads, Gemma's (1 + w) RMSNorm."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.caches.kv_cache import SlotKVCache, StaticKVCache
from qkv.attention.caches.quantized_cache import QuantizedKVCache
from qkv.attention.rmsnorm import RMSNorm
from qkv.attention.rope import RotaryEmbedding

C, H, H_KV, D, T, W = 32, 4, 2, 8, 11, 4


def layer(**options) -> GroupedQueryAttention:
    torch.manual_seed(0)
    return GroupedQueryAttention(C, H, num_kv_heads=H_KV, head_dim=D, **options).eval()


def inputs(batch: int = 2, tokens: int = T) -> torch.Tensor:
    return torch.randn(batch, tokens, C, generator=torch.Generator().manual_seed(1))


def reference(module: GroupedQueryAttention, x: torch.Tensor, allowed: torch.Tensor, *,
              softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """Plain torch: projections, GQA by repetition, one (T, S) mask built by loops."""
    b, t, _ = x.shape
    q = (x @ module.q_proj.weight.T).view(b, t, H, D).transpose(1, 2)
    k = (x @ module.k_proj.weight.T).view(b, t, H_KV, D).transpose(1, 2).repeat_interleave(H // H_KV, dim=1)
    v = (x @ module.v_proj.weight.T).view(b, t, H_KV, D).transpose(1, 2).repeat_interleave(H // H_KV, dim=1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(D) if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
    return module.o_proj((weights @ v).transpose(1, 2).reshape(b, t, H * D))


def window_allowed(t: int, window: int) -> torch.Tensor:
    return torch.tensor([[i - window < j <= i for j in range(t)] for i in range(t)])


@pytest.mark.parametrize("backend", ["explicit", "fused"])
def test_a_local_query_sees_only_its_window(backend: str) -> None:
    module, x = layer(window=W, backend=backend), inputs()
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(module, x, window_allowed(T, W)), rtol=0, atol=1e-5)
    assert module.window == W


@pytest.mark.parametrize("kind", [StaticKVCache, SlotKVCache])
def test_windowed_layer_with_a_full_cache_equals_the_whole_sequence(kind) -> None:
    module, x = layer(window=W), inputs()
    with torch.no_grad():
        whole = module(x)
        cache = kind(module.cache_spec(2, T, dtype=torch.float32, device="cpu"))
        steps = [module(x[:, :3], positions=torch.arange(3), cache=cache)]
        steps += [module(x[:, i:i + 1], positions=torch.tensor([i]), cache=cache) for i in range(3, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)


def test_windowed_slot_rows_at_their_own_positions() -> None:
    """A server's slot cache: row 1 alone, prefilled and decoded at its own positions."""
    module, x = layer(window=W), inputs()
    with torch.no_grad():
        whole = module(x[1:])  # (1, T, C)
        cache = SlotKVCache(module.cache_spec(3, T, dtype=torch.float32, device="cpu"))
        cache.selection.rows = torch.tensor([1])
        steps = [module(x[1:, :5], positions=torch.arange(5), cache=cache)]
        steps += [module(x[1:, i:i + 1], positions=torch.tensor([[i]]), cache=cache) for i in range(5, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)


def test_a_window_is_refused_on_a_cache_that_does_not_keep_slots_as_positions() -> None:
    module = layer(window=W)
    cache = QuantizedKVCache(module.cache_spec(1, 16, dtype=torch.float32, device="cpu"))
    with pytest.raises(ValueError, match="QuantizedKVCache"), torch.no_grad():
        module(inputs(1, 3), positions=torch.arange(3), cache=cache)


@pytest.mark.parametrize("backend", ["explicit", "fused"])
def test_soft_capped_scores_with_a_scale_of_their_own(backend: str) -> None:
    module, x = layer(softcap=0.5, scale=0.9, backend=backend), inputs()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(module, x, causal, softcap=0.5, scale=0.9), rtol=0, atol=1e-5)
        uncapped = reference(module, x, causal, scale=0.9)
    assert (module(x) - uncapped).abs().max() > 1e-3  # the cap binds at these scores


def test_partial_rotary_rotates_the_first_channels_as_transformers_does() -> None:
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    module, x = layer(rotary_dim=6), inputs()
    cos, sin = RotaryEmbedding(6)(torch.arange(T))  # (T, 6)
    q, k, _ = module.heads(x)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    torch.testing.assert_close(module.rotate(q, cos, sin), hf_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(module.rotate(k, cos, sin), hf_k, rtol=0, atol=1e-6)
    assert torch.equal(module.rotate(q, cos, sin)[..., 6:], q[..., 6:])


def test_qk_norm_over_all_heads_normalises_the_whole_projection() -> None:
    module, x = layer(qk_norm=True, qk_norm_over="all", norm_eps=1e-5), inputs()
    with torch.no_grad():
        module.q_norm.weight.uniform_(0.5, 1.5)
        q, k, _ = module.heads(x)
        expected_q = F.rms_norm(module.q_proj(x), (H * D,), module.q_norm.weight, eps=1e-5)  # (B, T, H*D)
        expected_k = F.rms_norm(module.k_proj(x), (H_KV * D,), module.k_norm.weight, eps=1e-5)
    torch.testing.assert_close(q, expected_q.view(2, T, H, D).transpose(1, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(k, expected_k.view(2, T, H_KV, D).transpose(1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rmsnorm_scales_by_one_plus_w_as_transformers_does(dtype: torch.dtype) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    ours, theirs = RMSNorm(C, 1e-6, weight_offset=1.0), Gemma3RMSNorm(C, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(-0.5, 0.5)
        theirs.weight.copy_(ours.weight)
    x = inputs().to(dtype)
    assert torch.equal(ours(x), theirs(x))


def test_bad_options_are_refused_by_name() -> None:
    for options, named in [({"window": 0}, "window"), ({"softcap": -1.0}, "softcap"), ({"rotary_dim": 7}, "rotary_dim"),
                           ({"qk_norm_over": "both"}, "qk_norm_over"), ({"scale": 0.0}, "scale")]:
        with pytest.raises(ValueError, match=named):
            layer(**options)


def test_a_window_cache_applies_the_window_once() -> None:
    """With a cache that keeps only the window (its slots are a ring, not positions), the
    layer leaves the window to the cache's mask: steps equal the whole sequence."""
    from qkv.attention.caches import window_cache

    module, x = layer(window=W), inputs()
    with torch.no_grad():
        whole = module(x)
        cache = window_cache.WindowKVCache(module.cache_spec(2, T, dtype=torch.float32, device="cpu"), window=W)
        steps = [module(x[:, :2], positions=torch.arange(2), cache=cache)]
        steps += [module(x[:, i:i + 1], positions=torch.tensor([i]), cache=cache) for i in range(2, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
