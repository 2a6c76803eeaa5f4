"""RMSNorm as Llama/Qwen compute it (normalise in float32, scale in the input dtype), and
with a weight offset as Gemma computes it (scale by 1 + w in float32, then cast).

Shape legend: any leading dimensions, C the normalised (last) dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / rms(x) * (weight + weight_offset) over the last dimension (C,).

    weight_offset 0 (Llama, Qwen, OLMo): the normalised x is cast back to its dtype and
    scaled there. weight_offset 1 (Gemma stores w and scales by 1 + w): scaled in float32,
    then cast, as Gemma's checkpoints were trained. Both are the same numbers in float32."""

    def __init__(self, dim: int, eps: float = 1e-6, *, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(dim) if weight_offset == 0.0 else torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x32 * (self.weight_offset + self.weight.float())).to(input_dtype)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"
