"""The key-value cache: keys and values of earlier tokens, kept for reuse while generating.

Preallocated (B, H_kv, S_max, D) buffers written in place at the current position, so a
decode step allocates nothing and each new token costs one row of attention instead of a
recomputation of the whole prefix. The buffers are not persistent: they never end up in a
checkpoint.

Shape legend: B batch, H_kv key/value heads, T new tokens, S_max capacity, D head size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    k_cache: Tensor
    v_cache: Tensor

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        value_dim: int | None = None,
    ) -> None:
        super().__init__()
        if min(batch_size, num_kv_heads, max_seq_len, head_dim) < 1:
            raise ValueError(
                f"KVCache sizes must be positive, got batch_size={batch_size}, "
                f"num_kv_heads={num_kv_heads}, max_seq_len={max_seq_len}, head_dim={head_dim}"
            )
        value_dim = head_dim if value_dim is None else value_dim
        shape_k = (batch_size, num_kv_heads, max_seq_len, head_dim)
        shape_v = (batch_size, num_kv_heads, max_seq_len, value_dim)
        self.register_buffer("k_cache", torch.zeros(shape_k, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape_v, dtype=dtype, device=device), persistent=False)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k_cache.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k_cache.shape[0]

    @property
    def nbytes(self) -> int:
        """Memory held by the two buffers, in bytes."""
        return self.k_cache.numel() * self.k_cache.element_size() + (
            self.v_cache.numel() * self.v_cache.element_size()
        )

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept and overwritten later)."""
        self.length = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write (B, H_kv, T, D) new keys/values at the current position.

        Returns views of every cached key and value so far: (B, H_kv, S, D), S = old + T.
        """
        b, h, _, d = self.k_cache.shape
        d_v = self.v_cache.shape[3]
        if (
            k.dim() != 4
            or v.dim() != 4
            or (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d)
            or (v.shape[0], v.shape[1], v.shape[2], v.shape[3]) != (b, h, k.shape[2], d_v)
        ):
            raise ValueError(
                f"KVCache holds batch {b} x {h} heads of size {d} (values {d_v}), "
                f"got keys of shape {tuple(k.shape)} and values of shape {tuple(v.shape)}"
            )
        start, new = self.length, k.shape[2]
        end = start + new
        if end > self.capacity:
            raise ValueError(
                f"KVCache is full: it holds {self.capacity} tokens, {start} are cached and "
                f"{new} more were written; make a larger cache or shorten the sequence"
            )
        self.k_cache[:, :, start:end] = k
        self.v_cache[:, :, start:end] = v
        self.length = end
        return self.k_cache[:, :, :end], self.v_cache[:, :, :end]

    def extra_repr(self) -> str:
        b, h, s, d = self.k_cache.shape
        return f"batch={b}, kv_heads={h}, capacity={s}, head_dim={d}, length={self.length}"
