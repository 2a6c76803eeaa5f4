"""Float32 linear layers on qkv's own kernel (`qkv.runtime.native`), for batch-1 decoding.

At a few rows a float32 linear layer is one pass over its weight, and PyTorch's CPU paths
read it at 13-19 GB/s here (`F.linear` with the (out, in) weight, `x @ W` with it stored
input-major), against 19-24 GB/s for qkv's kernel, which prefetches the next rows while it
computes (GPT-2-124M's products: 22.3 ms a token against 28.4 ms for the best PyTorch
layout of each layer, benchmarks/RESULTS.md). Up to `PROMPT_ROWS` rows the layer calls the
kernel; a prompt calls `F.linear`, whose blocked matrix product is faster there. Same
weights and the same product in another summation order: results agree to float rounding.

Where qkv's kernels cannot be built, `prepare_for_decoding` stores wide layers input-major
instead (`qkv.runtime.linear.transposed`).

Shape legend: K input features, N output features, M rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.runtime.linear.kernel import kernel_list
from qkv.runtime.native.ops import f32_linear
from qkv.runtime.linear.quantized import PROMPT_ROWS, replace_linears


class NativeFloatLinear(nn.Module):
    """nn.Linear's float32 product through qkv's kernel for decode-sized calls (see the
    module docstring); `weight` (N, K) and `bias` are nn.Linear's, not trainable."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float().contiguous(), requires_grad=False)  # (N, K)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False))

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if x.device.type != "cpu" or rows.shape[0] > PROMPT_ROWS or self.weight.dtype != rows.dtype:
            return F.linear(x, self.weight, self.bias)
        y = f32_linear(rows.contiguous(), self.weight, self.bias)  # (M, N)
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel_tensors(self) -> list[Tensor] | None:
        """[w, bias?] for qkv's whole-layer kernel (qkv.runtime.linear.kernel); None once the
        model is cast away from float32."""
        return kernel_list([self.weight], self.bias) if self.weight.dtype == torch.float32 else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, qkv kernel"


def use_native_float(model: nn.Module) -> int:
    """Replace every float32 nn.Linear of `model` by a NativeFloatLinear, in place (a tied
    output head gets its own copy). Returns the count."""
    return replace_linears(model, NativeFloatLinear, where=lambda linear: linear.weight.dtype.is_floating_point)
