"""Attention with soft-capped scores (Gemma 2): each scaled score s becomes
cap * tanh(s / cap) before the mask and the softmax, so no single key's logit can run
away. It needs the scores as a tensor, so it is always the explicit computation.

Shape legend: B batch, H query heads, H_kv key/value heads, T queries, S keys, D head size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.kernels import repeat_kv
from qkv.attention.masks import causal_mask


def softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, *, softcap: float, scale: float,
    mask: Tensor | None = None, is_causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """(B, H, T, D) queries, (B, H_kv, S, D) keys and values -> context (B, H, T, D) and
    weights (B, H, T, S). A query that sees no key gets zeros."""
    if softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])  # (B, H, S, D)
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, S)
    scores = torch.tanh(scores / softcap) * softcap
    t, s = q.shape[-2], k.shape[-2]
    visible = mask
    if is_causal:
        causal = causal_mask(t, s, device=q.device)  # (T, S): queries are the last T keys
        visible = causal if visible is None else visible & causal
    if visible is not None:
        scores = scores.masked_fill(~visible, -torch.inf)
    weights = torch.softmax(scores, dim=-1)
    if visible is not None:
        weights = weights.nan_to_num(0.0)  # a row with every key hidden attends to nothing
    weights = weights.to(q.dtype)
    return weights @ v, weights
