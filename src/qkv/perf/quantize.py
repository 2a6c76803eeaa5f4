"""Weight-only quantized linear layers for decoding: int8 per channel, int4 per group.

At batch 1 a decode step is a chain of matrix-vector products bound by the bytes of weight
they read, so fewer bytes per weight is speed. Both layers keep activations in float and
call PyTorch's own CPU kernels, the same call eagerly and under torch.compile (the
compiled graph calls the same kernel; it only fuses what lies between them):

- `Int8Linear`: symmetric, one scale per output row, q = round(w / s), s = max|w_row| / 127,
  so |w - q s| <= s / 2; `aten._weight_int8pack_mm`. A quarter of float32's bytes.
- `Int4Linear`: asymmetric, one scale and zero per group of `group_size` inputs of a row,
  w ~ (q - 8) * scale + zero with q in 0..15; `aten._weight_int4pack_mm_for_cpu` on the
  packed layout `aten._convert_weight_to_int4pack_for_cpu` makes. An eighth of float32's.

`quantize(model, "int8" | "int4")` replaces every `nn.Linear` of a model, the output head
included (a tied head gets its own quantized copy; the embedding keeps the float table,
since a token reads one row of it). With int4 the linear layers outside the stack of
repeated layers (the output head) are int8: the head is the most sensitive layer (GGUF's
Q4 files keep it at 8 bits too: SmolLM2's Q4_1 file stores it as Q8_0), and at 4 bits it
alone cost SmolLM2 about 3% perplexity. A layer the int4 kernel cannot take (input size
not a multiple of the group, outputs not a multiple of 16) stays int8 as well. The kernels exist on CPU; elsewhere (or on PyTorch without them) the layers
dequantize and call `F.linear`, the same numbers more slowly.

Shape legend: N output features, K input features, G group size, M rows (batch x tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.perf.compile import repeated_blocks

QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")
INT4_GROUP = 32  # GGUF's Q4 block size: SmolLM2's Q4_1 weights fall on the same groups

# From this many rows on (a prompt, not a decode step) the product is compute-bound: the
# int8 kernel runs row by row, while dequantizing once and calling the float matrix
# product is many times faster (measured: a 384-token SmolLM2 window took minutes).
PROMPT_ROWS = 16

_INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: returns q (N, K) int8 and scales (N,) float32, w ~ q * s."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (N,)
    q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # (N, K); in place: one temporary
    return q, scales


def quantize_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 per group of `group_size` inputs: q (N, K) in 0..15 (int32), scales
    and zeros (N, K/G) float32 with w ~ (q - 8) * scale + zero. The group's minimum and
    maximum are represented exactly (up to float rounding)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # (N, K/G, G)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/G)
    scales = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15)  # (N, K/G, G)
    zeros = low + 8.0 * scales  # so that q = 8 stands for low + 8 * scale
    return q.reshape(n, k).to(torch.int32), scales, zeros


class Int8Linear(nn.Module):
    """Weight-only int8 linear: int8 weights and float32 per-row scales, float activations.
    Weight and scales are buffers (not trainable); the bias keeps the original dtype."""

    weight: Tensor
    scales: Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  bias_dtype=linear.weight.dtype)
        q, scales = quantize_rows(linear.weight)
        new.weight.copy_(q)
        new.scales.copy_(scales)
        if linear.bias is not None:
            new.bias.data.copy_(linear.bias.detach())
        return new.to(linear.weight.device)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) weight the int8 values stand for."""
        return (self.weight.float() * self.scales[:, None]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if _INT8_MM is not None and x.device.type == "cpu" and rows.shape[0] <= PROMPT_ROWS:
            y = _INT8_MM(rows, self.weight, self.scales.to(x.dtype)).reshape(*x.shape[:-1], self.out_features)
        else:  # a prompt: float32 products are fast on every CPU (bfloat16 ones need AMX or AVX-512)
            y = F.linear(x.float(), self.dequantized(torch.float32)).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int4Linear(nn.Module):
    """Weight-only int4 linear, group-wise asymmetric (see the module docstring).

    `packed` is the kernel's layout of the 4-bit values; `scales_and_zeros` (K/G, N, 2) is
    what the kernel reads, kept in float32 (the activations' dtype is used at call time).
    """

    packed: Tensor
    scales_and_zeros: Tensor

    def __init__(self, in_features: int, out_features: int, *, group_size: int = INT4_GROUP,
                 bias: bool = True, bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_features % group_size != 0:
            raise ValueError(f"int4 groups of {group_size} must divide the input size {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.zeros(in_features // group_size, out_features, 2))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP) -> Int4Linear:
        new = cls(linear.in_features, linear.out_features, group_size=group_size,
                  bias=linear.bias is not None, bias_dtype=linear.weight.dtype)
        q, scales, zeros = quantize_groups(linear.weight.cpu(), group_size)
        new.packed = _pack_int4(q)
        new.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
        if linear.bias is not None:
            new.bias.data.copy_(linear.bias.detach())
        return new

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) weight the 4-bit values stand for (through the kernel: x = identity)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return _INT4_MM(eye, self.packed, self.group_size, self.scales_and_zeros).t().to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = _INT4_MM(rows, self.packed, self.group_size, self.scales_and_zeros.to(x.dtype))  # (M, N)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int4 groups of {self.group_size}")


def _pack_int4(q: Tensor) -> Tensor:
    return _INT4_PACK(q.contiguous(), 1)  # (N, K/2) uint8


def int4_fits(linear: nn.Linear, group_size: int) -> bool:
    """The int4 kernel's needs: groups that divide the inputs, outputs in multiples of 16
    (its packed layout), a CPU tensor."""
    return (linear.in_features % group_size == 0 and linear.out_features % 16 == 0
            and linear.weight.device.type == "cpu")


def int4_available() -> bool:
    return _INT4_PACK is not None and _INT4_MM is not None


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    where: Callable[[nn.Linear], bool] = lambda linear: True) -> int:
    """Replace every nn.Linear of `model` for which where(linear) holds by make(linear), in
    place. Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and where(child):
                setattr(parent, name, make(child))
                count += 1
    return count


def quantize(model: nn.Module, kind: str, *, group_size: int = INT4_GROUP) -> nn.Module:
    """Replace the model's linear layers (output head included) by `Int8Linear` or
    `Int4Linear`, in place (see the module docstring)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if kind == "int4" and not int4_available():
        raise ValueError("this PyTorch build has no CPU int4 kernels; use int8")

    blocks = repeated_blocks(model)
    in_stack = {id(m) for m in blocks.modules()} if blocks is not None else {id(m) for m in model.modules()}

    def make(linear: nn.Linear) -> nn.Module:
        four_bits = kind == "int4" and id(linear) in in_stack
        if four_bits and int4_fits(linear, group_size):
            return Int4Linear.from_linear(linear, group_size)
        return Int8Linear.from_linear(linear)

    with torch.no_grad():
        if replace_linears(model, make) == 0:
            raise ValueError("quantize found no nn.Linear layer in the model")
    return model
