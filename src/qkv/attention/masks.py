"""Attention masks as boolean tensors where True means "this query may see this key".

That is the convention of `torch.nn.functional.scaled_dot_product_attention`; the book
stores the opposite (1 above the diagonal = hidden) and its classes convert at the edge.

Shape legend: B batch, T query tokens, S key tokens (cache included).
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(
    num_queries: int,
    num_keys: int | None = None,
    *,
    offset: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """(T, S) mask letting the query at absolute position p see keys 0..p.

    Queries are the last `num_queries` tokens of a sequence of `num_keys` tokens unless
    `offset` says where the first query sits: with a KV cache holding `offset` earlier
    tokens, query i is at absolute position offset + i.
    """
    num_keys = num_queries if num_keys is None else num_keys
    if offset is None:
        offset = num_keys - num_queries
    if num_queries < 0 or num_keys < 0 or offset < 0:
        raise ValueError(
            f"causal_mask needs non-negative sizes, got num_queries={num_queries}, "
            f"num_keys={num_keys}, offset={offset}"
        )
    query_pos = torch.arange(num_queries, device=device).unsqueeze(1) + offset  # (T, 1)
    key_pos = torch.arange(num_keys, device=device).unsqueeze(0)  # (1, S)
    return key_pos <= query_pos  # (T, S)


def padding_mask(key_is_real: Tensor) -> Tensor:
    """(B, 1, 1, S) mask from a (B, S) tensor that is 1/True for real keys, 0 for padding."""
    if key_is_real.dim() != 2:
        raise ValueError(
            f"padding mask expects (batch, keys), got shape {tuple(key_is_real.shape)}"
        )
    return key_is_real.bool()[:, None, None, :]  # (B, 1, 1, S)


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of broadcastable masks; None stands for "no restriction"."""
    result: Tensor | None = None
    for mask in masks:
        if mask is None:
            continue
        result = mask if result is None else result & mask
    return result


def window_mask(key_positions: Tensor, query_positions: Tensor, window: int) -> Tensor:
    """The sliding window's half of a local layer's mask: the query at position p sees the
    keys at positions > p - window (itself and the window - 1 before it; causality, the
    other half, comes from the caller). key_positions (S,) or (B, S); query_positions (T,)
    or (B, T) -> (B or 1, 1, T, S) booleans."""
    if window < 1:
        raise ValueError(f"a sliding window holds at least one key, got {window}")
    if query_positions.dim() == 1:
        query_positions = query_positions[None]  # (1, T)
    if key_positions.dim() == 1:
        key_positions = key_positions[None]  # (1, S)
    return key_positions[:, None, None, :] > query_positions[:, None, :, None] - window  # (B, 1, T, S)
