"""Linear layers laid out for decoding: one row of activations times every weight.

At batch 1 a decode step is a chain of matrix-vector products, bound by the bytes of
weight they read. PyTorch's eager CPU paths for bfloat16 (and for int8 weights) are far
below memory bandwidth, so two replacements for `nn.Linear` are offered, both as model
transformations that the model and generation code need not know about:

- `DecodeLinear` (same parameters, shared, so tied weights stay tied). Eagerly, the
  weight is stored column-major, the layout PyTorch's CPU matrix-vector product reads
  fastest (optionally with a float32 copy for half-precision one-row products). Under
  torch.compile it keeps the row-major layout and writes the one-row product as a
  multiply-and-reduce, which Inductor turns into one vectorised loop over the weight
  rows at close to memory bandwidth, in float32 or reading bfloat16 as it is (an
  external matrix call is slower at one row). Results equal `nn.Linear`'s up to float
  rounding.
- `Int8Linear` (weight-only int8): per-output-channel symmetric quantization,
  q = round(w / s), s = max|w_row| / 127, so |w - q s| <= s / 2 for every weight. Under
  `torch.compile` a one-row input takes the same multiply-and-reduce path (1 byte per
  weight); otherwise `torch.ops.aten._weight_int8pack_mm` where it exists and the
  activation dtype suits it, else dequantize-then-`F.linear`.

`quantize_int8(model)` and `use_decode_linears(model)` replace the `nn.Linear` modules of a
model in place.

Shape legend: N output features, K input features, M rows of activations (batch x tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_INT8PACK = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_INT8PACK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Layout = Literal["column", "row"]
LAYOUTS: tuple[str, ...] = ("column", "row")


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _one_row(x: Tensor) -> bool:
    return x.numel() == x.shape[-1]


def _matvec(weight: Tensor, x: Tensor) -> Tensor:
    """(N, K) weight times a one-row x, as a float32 multiply-and-reduce. -> (N,) float32."""
    return (weight.float() * x.reshape(1, -1).float()).sum(dim=-1)  # (N,)


def column_major(weight: Tensor) -> Tensor:
    """The same (N, K) values stored column-major: `.t()` is a contiguous (K, N) tensor."""
    return weight.t().contiguous().t()


class DecodeLinear(nn.Linear):
    """`nn.Linear` with its weight stored for one-row products.

    - The (N, K) weight is stored column-major (its transpose is contiguous, the layout
      GPT-2's Conv1D checkpoints use): `F.linear` then runs `x @ W_t` on a contiguous
      (K, N) matrix, which PyTorch's float32 CPU path does markedly faster for one row
      than the row-major product (measured by `qkv bench`, decode section).
    - `matvec_dtype=torch.float32` on a bfloat16/float16 layer keeps a float32 copy of
      the weight for one-row products, for CPUs whose half-precision matrix-vector path
      is slow (twice the bytes, but float32 kernels); prompts still use the
      half-precision weight. `qkv bench` times both.
    (A float32 multiply-and-reduce over the bfloat16 weight under torch.compile was
    measured too: slower than the float32 copy on these CPUs, so it is not used.)
    """

    matvec_weight: Tensor | None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, matvec_dtype: torch.dtype | None = None, layout: Layout = "column"
    ) -> "DecodeLinear":
        """layout "column" suits eager decoding, "row" (the checkpoint's) compiled decoding.
        A `DecodeLinear` given here is laid out again (its float32 copy is dropped unless
        asked for again)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        weight = linear.weight
        with torch.no_grad():  # in place: tied modules see the new layout too
            weight.data = column_major(weight.data) if layout == "column" else weight.data.contiguous()
        new.weight = weight  # the same Parameter: ties and optimisers keep working
        new.bias = linear.bias
        copy = None
        if matvec_dtype is not None and matvec_dtype != weight.dtype:
            copy = column_major(weight.detach().to(matvec_dtype))
        new.register_buffer("matvec_weight", copy, persistent=False)
        return new

    def forward(self, x: Tensor) -> Tensor:
        if _is_compiling() and self.matvec_weight is None and _one_row(x):
            y = _matvec(self.weight, x)  # (N,) float32
            if self.bias is not None:
                y = y + self.bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.matvec_weight is not None and _one_row(x):
            w = self.matvec_weight
            bias = None if self.bias is None else self.bias.to(w.dtype)
            return F.linear(x.to(w.dtype), w, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: returns q (N, K) int8 and scales (N,) float32, w ~ q * s."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scales


class Int8Linear(nn.Module):
    """Weight-only int8 linear: int8 weights and float32 per-row scales, float activations.

    The weight and scales are persistent buffers (not trainable); the bias keeps the
    original dtype.
    """

    weight: Tensor
    scales: Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False)
            if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        bias = linear.bias
        new = cls(linear.in_features, linear.out_features, bias=bias is not None,
                  bias_dtype=linear.weight.dtype)
        q, scales = quantize_rows(linear.weight)
        new.weight.copy_(q)
        new.scales.copy_(scales)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new.to(linear.weight.device)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) weight the int8 values stand for."""
        return (self.weight.float() * self.scales[:, None]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        if _is_compiling():
            if _one_row(x):
                y = _matvec(self.weight, x) * self.scales  # (N,)
            else:
                y = (x.float() @ self.weight.float().t()) * self.scales  # (..., N)
            if self.bias is not None:
                y = y + self.bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if _INT8PACK is not None and x.dtype in _INT8PACK_DTYPES and x.device.type == "cpu":
            rows = x.reshape(-1, self.in_features).contiguous()  # (M, K)
            y = _INT8PACK(rows, self.weight, self.scales.to(x.dtype))  # (M, N)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _replace_linears(
    model: nn.Module, kinds: tuple[type, ...], make: Callable[[nn.Linear], nn.Module]
) -> int:
    """Replace every module whose exact type is in `kinds` by make(module). Returns the count."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in kinds:
                setattr(parent, name, make(child))
                count += 1
    return count


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the model's linear layers (output head included) by `Int8Linear`, in place.

    Embedding tables stay as they are (a token reads one row of them). A tied output head
    gets its own int8 copy; the embedding keeps the float table.
    """
    if _replace_linears(model, (nn.Linear, DecodeLinear), Int8Linear.from_linear) == 0:
        raise ValueError("quantize_int8 found no nn.Linear layer in the model")
    return model


def use_decode_linears(
    model: nn.Module, *, matvec_dtype: torch.dtype | None = None, layout: Layout = "column"
) -> nn.Module:
    """Swap every `nn.Linear` (and re-lay every `DecodeLinear`) for a `DecodeLinear`
    sharing its parameters, in place.

    layout: "column" for eager decoding, "row" for compiled decoding (see `DecodeLinear`).
    matvec_dtype: see `DecodeLinear`; a float32 copy of every weight for eager bfloat16
    one-row products (measured slower than the bfloat16 weight on AVX-512 CPUs; kept for
    CPUs whose half-precision matrix-vector path is slow).
    """
    _replace_linears(
        model, (nn.Linear, DecodeLinear),
        lambda linear: DecodeLinear.from_linear(linear, matvec_dtype=matvec_dtype, layout=layout),
    )
    return model
