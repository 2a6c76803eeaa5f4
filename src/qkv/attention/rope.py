"""Rotary position embedding (RoPE) in the rotate-half layout used by Hugging Face.

Each head vector is split into two halves (x1, x2); pair i = (x1[i], x2[i]) is rotated by
the angle position * inv_freq[i]. Rotating queries and keys by their own positions makes
q·k depend only on the distance between them. Because the layout is rotate-half, Hugging
Face Llama/Qwen weights load with no permutation of the q/k projection rows.

cos/sin are computed once per forward by the model and passed down to every layer.

Shape legend: B batch, H heads, T tokens, D head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency scaling: long wavelengths are slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor, "
                f"got factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}"
            )


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None
) -> Tensor:
    """(D/2,) rotation speeds, float32: theta ** (-2i / D), optionally Llama-3 scaled."""
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head size, got head_dim={head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns token positions into the (cos, sin) pair every attention layer applies."""

    inv_freq: Tensor

    def __init__(
        self, head_dim: int, *, theta: float = 10000.0, scaling: Llama3RopeScaling | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False
        )

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """positions: (T,) or (B, T) integers -> cos, sin of shape (T, D) or (B, T, D)."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)  # (..., T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, D) queries or keys; cos/sin are (T, D) or (B, T, D).

    The result keeps x's dtype (cos/sin are cast to it, as Hugging Face does), so float32
    tables never silently promote bf16/fp16 queries and keys away from their values.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): same for every head
    return x * cos + rotate_half(x) * sin
