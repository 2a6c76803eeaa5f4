"""Weight-only quantized linear layers for decoding: int8 per channel, int4 per block.

At batch 1 a decode step is a chain of matrix-vector products bound by the bytes of weight
they read, so fewer bytes per weight is speed. Both layers keep activations in float; the
same kernel runs eagerly and under torch.compile (the compiled graph calls it as one opaque
op and fuses only what lies between them):

- `Int8Linear`: symmetric, one scale per output row, q = round(w / s), s = max|w_row| / 127,
  so |w - q s| <= s / 2. A quarter of float32's bytes.
- `Int4Linear`: asymmetric blocks of 32 inputs, GGUF's Q4_1 layout (qkv.runtime.native.ops):
  w = q * d + m with q in 0..15, d = (max - min) / 15 and m = min in float16. Five bits a
  weight with the scales, against 32 for float32.

Kernels, chosen when a layer is made: qkv's own (`qkv.runtime.native`) where they build on this
machine, else the same math in PyTorch (`int8_linear_reference`, `int4_linear_reference`:
the activations rounded to int8 per block of 32 exactly as the kernel rounds them, exact
integer block dots, float32 sums, the same scales), slower, with one line saying so. Either
way a decode-sized call (up to NATIVE_ROWS rows) computes the same numbers, up to float32
summation order, so a precision means one thing with or without a compiler; longer prompts
multiply by the dequantized weight with `F.linear` on both.

`quantize(model, "int8" | "int4")` replaces every `nn.Linear` of a model, the output head
included (a tied head gets its own quantized copy; the embedding keeps the float table,
since a token reads one row of it). With int4 the linear layers outside the stack of
repeated layers (the output head) are int8: the head is the most sensitive layer (GGUF's
Q4 files keep it at 8 bits too: SmolLM2's Q4_1 file stores it as Q8_0), and at 4 bits it
alone cost SmolLM2 about 3% perplexity. A layer whose input size is not a multiple of 32
stays int8.

Shape legend: N output features, K input features, G = K / 32 blocks, M rows (batch x tokens).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.runtime.native import native_kernels
from qkv.runtime.linear.kernel import kernel_list
from qkv.runtime.native.ops import (BLOCK, dequantize_blocks, int4_linear, int4_linear_reference, int8_linear,
                            int8_linear_reference, pack_blocks, round_activations)
from qkv.runtime.compile import repeated_layers

QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")
INT4_GROUP = BLOCK  # GGUF's Q4 block size: SmolLM2's Q4_1 weights fall on the same blocks

# From this many rows on (a prompt, not a decode step) the product is compute-bound: the
# weight-only kernels work a row at a time, while dequantizing once and calling the float
# matrix product is many times faster (measured: a 384-token SmolLM2 window took minutes).
PROMPT_ROWS = 16
# qkv's kernels read the weights once for all the rows of a call, and dequantizing a layer for
# `F.linear` costs about 10 ms for SmolLM2's largest (fresh pages for the float copy), so
# they are used up to this many rows (measured: 32 rows of a 3072x576 layer, 1.3 ms). The
# PyTorch reference of their math takes the same calls, so that both give the same numbers;
# past it, an int4 layer rounds the activations as its kernel does before the float product,
# so a prompt and a decode step compute one precision's math (to float rounding).
NATIVE_ROWS = 128


def uses_native_kernels() -> bool:
    """Whether layers made now use qkv's kernels (built on first call; qkv.runtime.native)."""
    return native_kernels().available


def activation_dtype() -> torch.dtype:
    """The activations quantized layers run with: float32, on qkv's kernels and on their
    PyTorch reference alike (the same numbers either way)."""
    return torch.float32


@functools.lru_cache(maxsize=1)
def _say_reference_path(reason: str | None) -> None:
    print(f"qkv: quantized layers run qkv's kernel math in PyTorch, the slower path ({reason})", file=sys.stderr)


def _chooses_native(native: bool | None) -> bool:
    """A layer's kernel: qkv's where they are loaded, unless native=False asks for the
    PyTorch reference; saying once per process when the reference runs for want of them."""
    if native is False:
        return False
    if not uses_native_kernels():
        _say_reference_path(native_kernels().reason)
        return False
    return True


def _on_kernel(x: Tensor, rows: Tensor) -> bool:
    """Whether a call of `rows` (M, K) runs the weight-only math (qkv's kernel or its PyTorch
    reference, up to NATIVE_ROWS rows), rather than dequantizing for F.linear."""
    return x.device.type == "cpu" and rows.shape[0] <= NATIVE_ROWS


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: returns q (N, K) int8 and scales (N,) float32, w ~ q * s."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (N,)
    q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # (N, K); in place: one temporary
    return q, scales


def quantize_groups(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit blocks of 32 inputs (qkv.runtime.native.ops' layout): returns q (N, K/2)
    uint8, d and m (N, K/32) float16 with w ~ q * d + m. The block's minimum is m; its
    maximum is m + 15 d, up to float16 rounding of d and m."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)  # (N, G, 32)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # (N, G)
    d = ((high - low) / 15.0).half()
    m = low.half()
    step = d.float()[..., None]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((w - m.float()[..., None]) / safe).clamp_(0, 15)  # (N, G, 32)
    q = torch.where(step > 0, q, torch.zeros_like(q))  # a constant block is m exactly
    return pack_blocks(q.reshape(n, k)), d, m


def _bias_after(y: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    return y if bias is None else y + bias.to(dtype)


class Int8Linear(nn.Module):
    """Weight-only int8 linear: int8 weights and float32 per-row scales, float activations.
    Weight and scales are buffers (not trainable); the bias keeps the original dtype."""

    weight: Tensor
    scales: Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 bias_dtype: torch.dtype = torch.float32, native: bool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.native = _chooses_native(native)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, native: bool | None = None) -> Int8Linear:
        """`linear` quantized; native=False takes the PyTorch reference even where qkv's kernels exist."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  bias_dtype=linear.weight.dtype, native=native)
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
        decode = _on_kernel(x, rows)
        if decode and self.native:
            y = int8_linear(rows.float().contiguous(), self.weight, self.scales.float()).to(x.dtype)
        elif decode:  # the same math in PyTorch (module docstring)
            y = int8_linear_reference(rows, self.weight, self.scales).to(x.dtype)
        else:  # a prompt: float32 products are fast on every CPU (bfloat16 ones need AMX or AVX-512)
            y = F.linear(rows.float(), self.dequantized(torch.float32)).to(x.dtype)
        return _bias_after(y.reshape(*x.shape[:-1], self.out_features), self.bias, x.dtype)

    def kernel_tensors(self) -> list[Tensor] | None:
        """[w, scales, bias?] for qkv's whole-layer kernel (qkv.runtime.linear.kernel)."""
        if not self.native or self.scales.dtype != torch.float32:
            return None
        return kernel_list([self.weight, self.scales], self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int4Linear(nn.Module):
    """Weight-only 4-bit linear in blocks of 32 inputs (see the module docstring).

    `q` and the float16 `d`, `m` are the 4-bit blocks (qkv.runtime.native.ops' layout), what qkv's
    kernel reads. d and m are kept as their float16 bits in int16 buffers (`d_bits`,
    `m_bits`), so that `model.to(dtype)` leaves them exact. Without qkv's kernels the same
    blocks go through `int4_linear_reference`, the kernel's math in PyTorch.
    """

    q: Tensor
    d_bits: Tensor
    m_bits: Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 bias_dtype: torch.dtype = torch.float32, native: bool | None = None) -> None:
        super().__init__()
        if in_features % BLOCK != 0:
            raise ValueError(f"int4 blocks of {BLOCK} must divide the input size {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.native = _chooses_native(native)
        self.register_buffer("q", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("d_bits", torch.empty(out_features, in_features // BLOCK, dtype=torch.int16))
        self.register_buffer("m_bits", torch.empty(out_features, in_features // BLOCK, dtype=torch.int16))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        )

    @property
    def d(self) -> Tensor:
        return self.d_bits.view(torch.float16)  # (N, G)

    @property
    def m(self) -> Tensor:
        return self.m_bits.view(torch.float16)  # (N, G)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, native: bool | None = None) -> Int4Linear:
        """`linear` quantized; native=False takes the PyTorch reference even where qkv's kernels exist."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  bias_dtype=linear.weight.dtype, native=native)
        new.set_blocks(*quantize_groups(linear.weight.cpu()))
        if linear.bias is not None:
            new.bias.data.copy_(linear.bias.detach())
        return new

    def set_blocks(self, q: Tensor, d: Tensor, m: Tensor) -> None:
        """Take 4-bit blocks as they are (from `quantize_groups`, or a GGUF Q4_1 tensor)."""
        self.q = q.contiguous()
        self.d_bits = d.half().contiguous().view(torch.int16)
        self.m_bits = m.half().contiguous().view(torch.int16)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) weight the 4-bit blocks stand for."""
        return dequantize_blocks(self.q, self.d, self.m, dtype)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        decode = _on_kernel(x, rows)
        if decode and self.native:
            y = int4_linear(rows.float().contiguous(), self.q, self.d_bits, self.m_bits).to(x.dtype)
        elif decode:  # the same math in PyTorch (module docstring)
            y = int4_linear_reference(rows, self.q, self.d_bits, self.m_bits).to(x.dtype)
        else:  # a prompt: the kernel's math (activations rounded to int8 per block), one float product
            y = F.linear(round_activations(rows), self.dequantized(torch.float32)).to(x.dtype)
        return _bias_after(y.reshape(*x.shape[:-1], self.out_features), self.bias, x.dtype)

    def kernel_tensors(self) -> list[Tensor] | None:
        """[q, d_bits, m_bits, bias?] for qkv's whole-layer kernel (qkv.runtime.linear.kernel)."""
        return kernel_list([self.q, self.d_bits, self.m_bits], self.bias) if self.native else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int4 blocks of {BLOCK}")


def int4_fits(linear: nn.Linear) -> bool:
    """Whether a layer can be made int4: inputs in whole blocks, on the CPU."""
    return linear.in_features % BLOCK == 0 and linear.weight.device.type in ("cpu", "meta")


def int4_available() -> bool:
    """int4 runs everywhere: on qkv's kernels, or on their PyTorch reference."""
    return True


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


def quantize(model: nn.Module, kind: str, *, empty: bool = False) -> nn.Module:
    """Replace the model's linear layers (output head included) by `Int8Linear` or
    `Int4Linear`, in place (see the module docstring). empty=True makes the same layers
    without quantizing anything (their buffers uninitialised: no page is touched), for
    weights assigned next (qkv.runtime.prepared_cache, qkv.runtime.stored_four_bits)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANTIZATIONS)}")

    blocks = repeated_layers(model)
    in_stack = {id(m) for m in blocks.modules()} if blocks is not None else {id(m) for m in model.modules()}

    def make(linear: nn.Linear) -> nn.Module:
        four_bits = kind == "int4" and id(linear) in in_stack and int4_fits(linear)
        layer = Int4Linear if four_bits else Int8Linear
        if empty:
            return layer(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         bias_dtype=linear.weight.dtype)
        return layer.from_linear(linear)

    with torch.no_grad():
        if replace_linears(model, make) == 0:
            raise ValueError("quantize found no nn.Linear layer in the model")
    return model
