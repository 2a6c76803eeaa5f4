"""Both attention backends against torch's scaled_dot_product_attention and softmax(QKᵀ/√d).

The reference for every comparison is PyTorch's own kernel (run on the same inputs, with
masks built independently of qkv.attention.masks) or the formula written out in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import attention, explicit_attention, one_query_attention, padding_mask

BACKENDS = ("explicit", "fused")
RANKS = (2, 3, 4)  # (T, D), (B, T, D), (B, H, T, D)
MASK_KINDS = ("none", "causal", "causal_offset", "padding", "causal_padding")
FAST = settings(max_examples=8, deadline=None)

# Half precision: both sides round differently (the explicit path rounds the scores and
# the weights to the input dtype, the fused kernel keeps them in float32).
TOLERANCES = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def _reference_causal(num_queries: int, num_keys: int, offset: int) -> torch.Tensor:
    """(T, S): query i (absolute position offset + i) may see key j iff j <= offset + i."""
    allowed = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for i in range(num_queries):
        allowed[i, : offset + i + 1] = True
    return allowed


def _make_case(data, rank: int, mask_kind: str, dtype: torch.dtype):
    """Random q, k, v of the given rank, a mask for the reference, and the qkv call's mask args."""
    b = data.draw(st.integers(1, 3), label="B")
    h = data.draw(st.integers(1, 4), label="H")
    t = data.draw(st.integers(1, 9), label="T")
    d = data.draw(st.sampled_from([1, 4, 8, 16, 32]), label="D")
    offset = data.draw(st.integers(1, 6), label="offset") if mask_kind == "causal_offset" else 0
    s = t + offset
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    lead = {2: (), 3: (b,), 4: (b, h)}[rank]
    q = torch.randn(*lead, t, d, generator=gen).to(dtype)
    k = torch.randn(*lead, s, d, generator=gen).to(dtype)
    v = torch.randn(*lead, s, d, generator=gen).to(dtype)

    ref_mask = None
    kwargs: dict = {}
    if mask_kind in ("causal", "causal_offset", "causal_padding"):
        ref_mask = _reference_causal(t, s, offset)
        kwargs["is_causal"] = True
    if mask_kind in ("padding", "causal_padding"):
        # Key 0 stays real so that no query row is fully masked (tested separately).
        real = torch.rand(b, s, generator=gen) > 0.4  # (B, S)
        real[:, 0] = True
        if rank == 2:
            real = real[:1]
            pad, ref_pad = real, real  # (1, S) broadcasts over (T, S)
        elif rank == 3:
            pad = ref_pad = real[:, None, :]  # (B, 1, S)
        else:
            pad, ref_pad = padding_mask(real), real[:, None, None, :]  # (B, 1, 1, S)
        kwargs["mask"] = pad
        ref_mask = ref_pad if ref_mask is None else ref_pad & ref_mask
    return q, k, v, ref_mask, kwargs


def _sdpa(q, k, v, ref_mask, **kw):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@FAST
@given(data=st.data())
def test_matches_sdpa_fp32(backend, rank, mask_kind, data):
    q, k, v, ref_mask, kwargs = _make_case(data, rank, mask_kind, torch.float32)
    out = attention(q, k, v, backend=backend, **kwargs)
    torch.testing.assert_close(out, _sdpa(q, k, v, ref_mask), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask_kind", ["none", "causal_offset", "causal_padding"])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_matches_sdpa_half_precision(backend, dtype, mask_kind, data):
    q, k, v, ref_mask, kwargs = _make_case(data, 4, mask_kind, dtype)
    out = attention(q, k, v, backend=backend, **kwargs)
    assert out.dtype == dtype
    # The reference: PyTorch's kernel on the same rounded inputs, in float32.
    ref = _sdpa(q.float(), k.float(), v.float(), ref_mask)
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal_offset", "causal_padding"])
@FAST
@given(data=st.data(), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]))
def test_grouped_query_matches_repeat_interleave(backend, mask_kind, data, kv_heads, group):
    q, k, v, ref_mask, kwargs = _make_case(data, 4, mask_kind, torch.float32)
    b, _, t, d = q.shape
    s = k.shape[-2]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(b, kv_heads * group, t, d, generator=gen)
    k = torch.randn(b, kv_heads, s, d, generator=gen)
    v = torch.randn(b, kv_heads, s, d, generator=gen)
    out = attention(q, k, v, backend=backend, **kwargs)
    ref = _sdpa(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), ref_mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0.0)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@FAST
@given(data=st.data(), rank=st.sampled_from(RANKS))
def test_explicit_weights_are_softmax_of_scaled_scores(mask_kind, rank, data):
    q, k, v, ref_mask, kwargs = _make_case(data, rank, mask_kind, torch.float32)
    context, weights = explicit_attention(q, k, v, **kwargs)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if ref_mask is not None:
        scores = scores.masked_fill(~ref_mask, -math.inf)
    ref_weights = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(weights.double(), ref_weights, atol=1e-6, rtol=0.0)
    torch.testing.assert_close(context.double(), ref_weights @ v.double(), atol=1e-5, rtol=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@FAST
@given(data=st.data(), scale=st.floats(0.01, 2.0))
def test_custom_scale_matches_sdpa(backend, data, scale):
    q, k, v, ref_mask, kwargs = _make_case(data, 4, "causal_padding", torch.float32)
    out = attention(q, k, v, backend=backend, scale=scale, **kwargs)
    torch.testing.assert_close(out, _sdpa(q, k, v, ref_mask, scale=scale), atol=1e-6, rtol=1e-6)


def test_backends_agree_on_gradients():
    gen = torch.Generator().manual_seed(0)
    grads = {}
    for backend in BACKENDS:
        gen.manual_seed(0)
        q, k, v = (torch.randn(2, 3, 5, 8, generator=gen, requires_grad=True) for _ in range(3))
        real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        out = attention(q, k, v, mask=padding_mask(real), is_causal=True, backend=backend)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        grads[backend] = (q.grad, k.grad, v.grad)
    for g_explicit, g_fused in zip(grads["explicit"], grads["fused"]):
        torch.testing.assert_close(g_explicit, g_fused, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_dims_are_batch_tokens_features_never_grouped(backend):
    """In (B, T, D) dim -3 is the batch: keys of batch 1 broadcast, other sizes are an error."""
    q, k, v = torch.randn(4, 3, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    out = attention(q, k, v, backend=backend)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=0.0)
    with pytest.raises(ValueError, match=r"batch dimension 0.*q \(4, 3, 8\), k \(2, 5, 8\)"):
        attention(q, torch.randn(2, 5, 8), torch.randn(2, 5, 8), backend=backend)
    with pytest.raises(ValueError, match=r"batch dimension 0"):
        attention(torch.randn(4, 2, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_query_in_bf16_rope_pipeline_keeps_dtype(backend):
    from qkv.attention import GroupedQueryAttention, RotaryEmbedding

    layer = GroupedQueryAttention(16, 4, num_kv_heads=2, backend=backend).to(torch.bfloat16).eval()
    cos, sin = RotaryEmbedding(4)(torch.arange(5))  # float32 tables, bf16 activations
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x, cos=cos, sin=sin)
        ref = layer.float()(x.float(), cos=cos, sin=sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_bad_inputs_raise_value_errors():
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="boolean"):
        attention(q, q, q, mask=torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"q\[\.\.\., 8\] and k\[\.\.\., 6\]"):
        attention(q, torch.randn(2, 3, 4, 6), q)
    with pytest.raises(ValueError, match="4 keys and 5 values"):
        attention(q, q, torch.randn(2, 3, 5, 8))
    with pytest.raises(ValueError, match=r"query heads \(3\).*key/value heads \(k: 2"):
        attention(q, torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8))
    for backend in BACKENDS:  # causal queries are the last keys: there must be enough keys
        with pytest.raises(ValueError, match="5 queries and 3 keys"):
            attention(torch.randn(5, 8), torch.randn(3, 8), torch.randn(3, 8), is_causal=True, backend=backend)
        with pytest.raises(ValueError, match="5 queries and 3 keys"):
            attention(
                torch.randn(5, 8), torch.randn(3, 8), torch.randn(3, 8),
                mask=torch.ones(3, dtype=torch.bool), is_causal=True, backend=backend,
            )
    with pytest.raises(ValueError, match="same number of dimensions"):
        attention(q, q[0], q[0])
    with pytest.raises(ValueError, match="'flash'.*explicit, fused"):
        attention(q, q, q, backend="flash")  # type: ignore[arg-type]


@FAST
@given(
    lead=st.sampled_from([(), (2,), (1, 3), (2, 4)]),
    keys=st.integers(1, 40),
    d=st.sampled_from([1, 8, 64]),
    kv_divisor=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_one_query_attention_matches_sdpa(lead, keys, d, kv_divisor, dtype, seed) -> None:
    """The decode-step form (two reductions, used under torch.compile) against SDPA,
    grouped-query included for (B, H, 1, D)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, 1, d, generator=gen).to(dtype)
    kv_lead = lead
    if len(lead) == 2 and lead[1] % kv_divisor == 0:
        kv_lead = (lead[0], lead[1] // kv_divisor)
    k = torch.randn(*kv_lead, keys, d, generator=gen).to(dtype)
    v = torch.randn(*kv_lead, keys, d, generator=gen).to(dtype)
    out = one_query_attention(q, k, v)
    if kv_lead != lead:
        k = k.repeat_interleave(lead[1] // kv_lead[1], dim=-3)
        v = v.repeat_interleave(lead[1] // kv_lead[1], dim=-3)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCES[dtype] if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), expected, **tol)


@FAST
@given(
    keys=st.integers(1, 40),
    kv_divisor=st.sampled_from([1, 3]),
    per_row=st.booleans(),
    hide_a_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_query_attention_with_a_mask_matches_explicit_attention(keys, kv_divisor, per_row, hide_a_row,
                                                                   seed) -> None:
    """A masked decode step (what a KV cache's position mask asks for), grouped-query
    included, against the explicit reference; rows whose keys are all hidden give zeros."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d = 3, 6, 8
    q = torch.randn(b, h, 1, d, generator=gen)
    k = torch.randn(b, h // kv_divisor, keys, d, generator=gen)
    v = torch.randn(b, h // kv_divisor, keys, d, generator=gen)
    mask = torch.rand(b if per_row else 1, 1, 1, keys, generator=gen) < 0.6  # (B|1, 1, 1, S)
    if hide_a_row:
        mask[0] = False
    expected, _ = explicit_attention(q, k, v, mask=mask)
    torch.testing.assert_close(one_query_attention(q, k, v, mask=mask), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention(q, k, v, mask=mask), expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_runs_the_same_math_eager_and_compiled() -> None:
    """One code path for a decode step: compiled (Dynamo, eager backend: no C++ compiler
    needed) it gives what it gives eagerly."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    mask = torch.arange(9)[None, None, None, :] <= torch.tensor([4, 8])[:, None, None, None]

    def run(q, k, v, mask):
        return attention(q, k, v, mask=mask)

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="eager", fullgraph=True)(q, k, v, mask)
    torch.testing.assert_close(compiled, run(q, k, v, mask), atol=0, rtol=0)
