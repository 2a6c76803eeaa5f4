"""How GGUF lays a tensor out against Hugging Face: its dimensions innermost first, and the q/k
rows llama.cpp's converter reordered for its interleaved RoPE (rotate-half halves <-> pairs).

Shared by the tensors that are dequantized (qkv.models.gguf.tensors) and those kept as stored
blocks (qkv.models.gguf.stored).

Shape legend: C embedding (hidden size), H heads, D head size, R rows of a projection (H*D).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.models.gguf import arch as gguf_arch


def unpermute_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order: interleaved RoPE pairs -> rotate-half halves.

    Within each head llama.cpp stores rows as (pair 0: row 0, row D/2), (pair 1: row 1,
    row D/2 + 1), ...; Hugging Face (and qkv) keep the first halves, then the second halves.
    """
    rows, cols = weight.shape
    d_half = rows // num_heads // 2
    w = weight.reshape(num_heads, d_half, 2, cols)  # (H, D/2, 2, C): GGUF's pairs
    return w.transpose(1, 2).reshape(rows, cols)  # (H, 2, D/2, C) -> (R, C)


def permute_rows(weight: Tensor, num_heads: int) -> Tensor:
    """llama.cpp's q/k row order from the rotate-half one (the inverse of `unpermute_rows`)."""
    rows, cols = weight.shape
    d_half = rows // num_heads // 2
    w = weight.reshape(num_heads, 2, d_half, cols)  # (H, 2, D/2, C): two halves per head
    return w.transpose(1, 2).reshape(rows, cols)  # (H, D/2, 2, C) -> (R, C)


def gguf_shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's shape as PyTorch orders it (outermost first)."""
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first


def rope_heads(name: str, config: dict[str, Any], arch: gguf_arch.Architecture) -> int | None:
    """How many heads' rows llama.cpp reordered in this tensor (q and k of the llama-ordered
    architectures), else None."""
    if not arch.permuted_qk:
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return config["num_attention_heads"]
    if name.endswith("self_attn.k_proj.weight"):
        return config["num_key_value_heads"]
    return None


def rows_in_hf_order(data: np.ndarray, heads: int | None) -> np.ndarray:
    """The tensor's stored rows, q/k ones put back in rotate-half order (`unpermute_rows`).

    A row of a GGUF tensor is whole blocks, so reordering rows of bytes before decoding
    gives the same values as reordering the decoded rows, for a sixth of the bytes moved.
    """
    if heads is None:
        return data
    order = unpermute_rows(torch.arange(data.shape[0])[:, None], heads)[:, 0]  # (R,): stored row per HF row
    return data[order.numpy()]  # (R, bytes per row), a copy

