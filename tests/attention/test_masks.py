"""Masks: causal (with the KV-cache offset), key padding, and their combination."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import causal_mask, combine_masks, padding_mask

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(t=st.integers(0, 12), cached=st.integers(0, 12))
def test_causal_mask_query_at_position_p_sees_keys_0_to_p(t, cached):
    s = cached + t
    mask = causal_mask(t, s, offset=cached)
    assert mask.shape == (t, s) and mask.dtype == torch.bool
    for i in range(t):
        p = cached + i  # absolute position of query i
        assert mask[i, : p + 1].all()
        assert not mask[i, p + 1 :].any()
    # The same band as torch.tril with the diagonal shifted by the number of cached keys.
    assert torch.equal(mask, torch.ones(t, s, dtype=torch.bool).tril(diagonal=cached))


@FAST
@given(t=st.integers(1, 12), cached=st.integers(0, 12))
def test_causal_mask_default_aligns_queries_with_last_keys(t, cached):
    s = cached + t
    assert torch.equal(causal_mask(t, s), causal_mask(t, s, offset=cached))
    assert torch.equal(causal_mask(t), torch.ones(t, t, dtype=torch.bool).tril())


@FAST
@given(t=st.integers(1, 8), s=st.integers(1, 8), offset=st.integers(0, 20))
def test_causal_mask_explicit_offset_is_independent_of_alignment(t, s, offset):
    mask = causal_mask(t, s, offset=offset)
    ref = torch.arange(s)[None, :] <= (torch.arange(t)[:, None] + offset)
    assert torch.equal(mask, ref)


def test_causal_mask_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match=r"num_queries=5, num_keys=3, offset=-2"):
        causal_mask(5, 3)  # more queries than keys: they cannot be the last keys
    with pytest.raises(ValueError, match=r"num_queries=-1"):
        causal_mask(-1, 4)
    with pytest.raises(ValueError, match=r"offset=-1"):
        causal_mask(2, 4, offset=-1)


@FAST
@given(b=st.integers(1, 4), s=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_padding_mask_shape_and_values(b, s, seed):
    real = torch.rand(b, s, generator=torch.Generator().manual_seed(seed)) > 0.5
    for as_given in (real, real.long(), real.float()):
        mask = padding_mask(as_given)
        assert mask.shape == (b, 1, 1, s) and mask.dtype == torch.bool
        assert torch.equal(mask[:, 0, 0, :], real)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_padding_mask_bad_shape_raises_value_error(shape):
    with pytest.raises(ValueError, match=r"\(batch, keys\).*" + str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")):
        padding_mask(torch.ones(shape))


def test_combine_masks_ands_and_ignores_none():
    causal = causal_mask(3, 4)  # (3, 4)
    pad = padding_mask(torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]]))  # (2, 1, 1, 4)
    combined = combine_masks(None, causal, None, pad)
    assert combined is not None and combined.shape == (2, 1, 3, 4)
    assert torch.equal(combined, causal[None, None] & pad)
    assert combine_masks(None, None) is None
    assert combine_masks(causal) is causal
