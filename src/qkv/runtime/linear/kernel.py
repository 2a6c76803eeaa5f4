"""The one interface between a linear layer and qkv's whole-layer kernel.

Every linear kind a prepared decoder holds says itself what the kernel reads of it
(runtime/native/csrc/kernels.h's `Linear`), so the layer step asks each layer once and
knows no layer kinds:

    tensors = layer.kernel_tensors()   # list[Tensor], or None: the kernel cannot run this layer

The lists, by kind: float32 [w, bias?] (`float.NativeFloatLinear`), int8 [w, scales, bias?]
and 4-bit blocks [q, d_bits, m_bits, bias?] (`quantized`), a GGUF file's blocks
[blocks, type, (blocks, type)..., bias?] (`block`). A layer that is none of these (torch's
nn.Linear, a bfloat16 layer, `transposed.InputMajorLinear`) runs as a module.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class KernelLinear(Protocol):
    """A linear layer that can say what qkv's kernel reads of it (module docstring)."""

    def kernel_tensors(self) -> list[Tensor] | None: ...


def kernel_list(tensors: list[Tensor], bias: Tensor | None) -> list[Tensor] | None:
    """`tensors` then the bias, as the kernel reads them: None when the bias is not float32 or
    a tensor is not contiguous on the CPU (the kernel reads raw CPU memory)."""
    if bias is not None and bias.dtype != torch.float32:
        return None
    listed = tensors if bias is None else [*tensors, bias]
    return listed if all(t.is_contiguous() and t.device.type == "cpu" for t in listed) else None
