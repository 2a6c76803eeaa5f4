"""RoPE: the rotate-half layout against transformers' Llama code, and the properties that
make it a position encoding (relative positions only, norms kept)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

from qkv.attention import Llama3RopeScaling, RotaryEmbedding, apply_rope, inverse_frequencies, rotate_half

FAST = settings(max_examples=30, deadline=None)

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def _hf_rotary(head_dim: int, theta: float, llama3: dict | None) -> LlamaRotaryEmbedding:
    rope = {"rope_type": "default", "rope_theta": theta}
    if llama3 is not None:
        rope = {"rope_type": "llama3", "rope_theta": theta, **llama3}
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_parameters=rope,
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("scaled", [False, True], ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (64, 500000.0), (32, 100000.0)])
def test_cos_sin_and_rotation_match_transformers(scaled, head_dim, theta):
    llama3 = LLAMA3 if scaled else None
    ours = RotaryEmbedding(
        head_dim, theta=theta, scaling=Llama3RopeScaling(**llama3) if llama3 else None
    )
    hf = _hf_rotary(head_dim, theta, llama3)
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, atol=0.0, rtol=0.0)
    if scaled:  # the scaling changes something, or the comparison above proves little
        assert not torch.allclose(ours.inv_freq, inverse_frequencies(head_dim, theta))

    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 400, (2, 7), generator=gen)  # (B, T)
    x = torch.randn(2, 3, 7, head_dim, generator=gen)  # (B, H, T, D)
    k = torch.randn(2, 1, 7, head_dim, generator=gen)  # (B, H_kv, T, D)
    cos, sin = ours(positions)
    hf_cos, hf_sin = hf(x, positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0.0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0.0)
    hf_q, hf_k = apply_rotary_pos_emb(x, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), hf_q, atol=1e-6, rtol=0.0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k, atol=1e-6, rtol=0.0)
    # (T,) positions give (T, D) tables shared by the batch.
    cos1, sin1 = ours(positions[0])
    torch.testing.assert_close(apply_rope(x[:1], cos1, sin1), hf_q[:1], atol=1e-6, rtol=0.0)


def test_rotate_half_matches_transformers():
    x = torch.randn(3, 4, 10)
    assert torch.equal(rotate_half(x), hf_rotate_half(x))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_cos_sin_dtype():
    cos, sin = RotaryEmbedding(16)(torch.arange(5), dtype=torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (5, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotation_keeps_the_input_dtype_like_transformers(dtype):
    """float32 tables must not promote half-precision queries (q, k and v must share a dtype)."""
    x = torch.randn(1, 2, 5, 16).to(dtype)
    cos, sin = RotaryEmbedding(16)(torch.arange(5))  # float32
    rotated = apply_rope(x, cos, sin)
    assert rotated.dtype == dtype
    hf_q, _ = apply_rotary_pos_emb(x, x, cos[None].to(dtype), sin[None].to(dtype))  # HF: tables in x dtype
    assert torch.equal(rotated, hf_q)


@FAST
@given(
    m=st.integers(0, 200),
    n=st.integers(0, 200),
    shift=st.integers(-100, 100),
    head_dim=st.sampled_from([2, 8, 32]),
    seed=st.integers(0, 2**16),
)
def test_dot_product_depends_only_on_relative_position(m, n, shift, head_dim, seed):
    m2, n2 = m + shift, n + shift
    if min(m2, n2) < 0:
        m2, n2 = m - shift, n - shift
    rope = RotaryEmbedding(head_dim)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, head_dim, generator=gen, dtype=torch.float64)

    def rotated_dot(pos_q: int, pos_k: int) -> torch.Tensor:
        cos_q, sin_q = rope(torch.tensor([pos_q]), dtype=torch.float64)
        cos_k, sin_k = rope(torch.tensor([pos_k]), dtype=torch.float64)
        return (apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum()

    # Angles are computed in float32 (as transformers does): position * inv_freq rounds
    # at about 1e-5 for positions in the hundreds.
    torch.testing.assert_close(rotated_dot(m, n), rotated_dot(m2, n2), atol=1e-3 * head_dim, rtol=1e-4)
    if m == n:  # same position: the rotation cancels exactly in the dot product
        torch.testing.assert_close(rotated_dot(m, n), (q * k).sum(), atol=1e-6 * head_dim, rtol=1e-6)


@FAST
@given(t=st.integers(1, 20), head_dim=st.sampled_from([2, 16, 64]), seed=st.integers(0, 2**16))
def test_rotation_preserves_norms(t, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, t, head_dim, generator=gen)
    positions = torch.randint(0, 10_000, (t,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim)(positions)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_position_zero_is_the_identity():
    x = torch.randn(1, 2, 1, 8)
    cos, sin = RotaryEmbedding(8)(torch.zeros(1, dtype=torch.long))
    assert torch.equal(apply_rope(x, cos, sin), x)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="head_dim=7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="factor=0"):
        Llama3RopeScaling(factor=0, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8)
    with pytest.raises(ValueError, match="low_freq_factor=4.*high_freq_factor=1"):
        Llama3RopeScaling(factor=8, low_freq_factor=4, high_freq_factor=1, original_max_position_embeddings=8)
