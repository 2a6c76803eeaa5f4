"""RoPE variants beyond plain and Llama-3 scaling: linear position interpolation (Gemma 3's
global layers), LongRoPE (Phi-3 128k, Phi-4-mini: per-frequency factors, one set for short
and one for long sequences, and cos/sin scaled by an attention factor) and partial rotary
(only the first `rotary_dim` channels of a head rotate).

`scaled_rotary(rotary_dim, base, scaling)` gives the module that turns positions into
(cos, sin) of width rotary_dim; `scaling` is a config's `rope_scaling` dict as read by the
model's config reader (None or rope_type "default": plain RoPE).

Shape legend: T tokens, B batch, R rotated channels of a head (rotary_dim).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from qkv.attention.rope import Llama3RopeScaling, RotaryEmbedding, inverse_frequencies

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _factors(values: object, rotary_dim: int, name: str) -> Tensor:
    if not isinstance(values, Sequence) or len(values) != rotary_dim // 2:
        raise ValueError(f"LongRoPE's {name} must list {rotary_dim // 2} numbers (one per rotated channel pair)")
    factors = torch.tensor([float(v) for v in values], dtype=torch.float32)  # type: ignore[union-attr]
    if not bool((factors > 0).all()) or not bool(torch.isfinite(factors).all()):
        raise ValueError(f"LongRoPE's {name} must be positive numbers")
    return factors


class ScaledRotaryEmbedding(RotaryEmbedding):
    """(cos, sin) for RoPE with linear or LongRoPE scaling (module docstring).

    LongRoPE picks the long factors for a call whose furthest position reaches past
    `original_max_position_embeddings`, else the short ones (as transformers does, with a
    tensor comparison: no read back into Python), and multiplies cos and sin by
    `attention_factor`."""

    long_inv_freq: Tensor | None

    def __init__(self, rotary_dim: int, *, theta: float, scaling: Mapping[str, object]) -> None:
        super().__init__(rotary_dim, theta=theta)
        kind = scaling.get("rope_type", "default")
        self.rope_type = kind
        self.attention_factor = 1.0
        self.original_max_positions: int | None = None
        long: Tensor | None = None
        plain = inverse_frequencies(rotary_dim, theta)  # (R/2,)
        if kind == "linear":
            factor = float(scaling["factor"])  # type: ignore[arg-type]
            self.inv_freq = plain / factor
        elif kind == "longrope":
            self.inv_freq = plain / _factors(scaling.get("short_factor"), rotary_dim, "short_factor")
            long = plain / _factors(scaling.get("long_factor"), rotary_dim, "long_factor")
            self.original_max_positions = int(scaling["original_max_position_embeddings"])  # type: ignore[call-overload]
            self.attention_factor = float(scaling["attention_factor"])  # type: ignore[arg-type]
        elif kind != "default":
            raise ValueError(f"RoPE scaling type {str(kind)[:40]!r} is not supported here (qkv knows {', '.join(ROPE_TYPES)})")
        self.register_buffer("long_inv_freq", long, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """positions (T,) or (B, T) -> cos, sin of shape (T, R) or (B, T, R)."""
        inv_freq = self.inv_freq.to(positions.device)  # (R/2,)
        if self.long_inv_freq is not None and positions.numel():
            is_long = positions.max() + 1 > self.original_max_positions  # a 0-d tensor
            inv_freq = torch.where(is_long, self.long_inv_freq.to(positions.device), inv_freq)
        angles = positions.float().unsqueeze(-1) * inv_freq  # (..., T, R/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., T, R)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def scaled_rotary(rotary_dim: int, base: float, scaling: Mapping[str, object] | None) -> RotaryEmbedding:
    """The RoPE module for one layer description: the plain `RotaryEmbedding` for default
    and Llama-3 scaling (what qkv's other code and kernels know), else ScaledRotaryEmbedding."""
    kind = "default" if not scaling else scaling.get("rope_type", "default")
    if kind == "default":
        return RotaryEmbedding(rotary_dim, theta=base)
    if kind == "llama3":
        assert scaling is not None
        llama3 = Llama3RopeScaling(
            factor=float(scaling["factor"]),  # type: ignore[arg-type]
            low_freq_factor=float(scaling["low_freq_factor"]),  # type: ignore[arg-type]
            high_freq_factor=float(scaling["high_freq_factor"]),  # type: ignore[arg-type]
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),  # type: ignore[call-overload]
        )
        return RotaryEmbedding(rotary_dim, theta=base, scaling=llama3)
    assert scaling is not None
    return ScaledRotaryEmbedding(rotary_dim, theta=base, scaling=scaling)
