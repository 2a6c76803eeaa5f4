"""`qkv::block_linear` and `qkv::block_decode` (block_products.cpp) as Python functions, the
activations' rounding they multiply by written in torch (the tests' and the torch
reference's), the op's fake implementation (what torch.compile traces) and its self-test, so
that a library whose block products compute wrong is never used for them.

The activation rounding belongs to the weight type (block_format.h): a matrix of 32-weight
blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) multiplies activations rounded per 32 inputs, a
K-quant (Q2_K .. Q6_K), IQ4_XS or grid type (IQ1_S, IQ2_*, IQ3_*; super-blocks of 256)
activations rounded per 256, each with the step max|x| / 127 and codes round(x / step), ties
to even. The product is the dequantized weights times those rounded activations, up to float32
summation order, on every CPU: the generic C++, AVX2 and AVX-512 variants compute the same
exact integer sums per block. A matrix of
plain 16-bit floats (F16, BF16) multiplies the activations as they are, in float32 (not
rounded: activation step 0), its product a float32 sum of w x.

Shape legend: M rows of x, K inputs, N outputs.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from torch import Tensor

from qkv.models.gguf.dequantize import BLOCK_FORMATS

# every block type qkv decodes (qkv.models.gguf.dequantize.BLOCK_FORMATS) has a native product
NATIVE_TYPES = frozenset(BLOCK_FORMATS)


def activation_step(block_type: Q) -> int:
    """How many inputs share one activation step for `block_type`: 256 for the K-quants'
    super-blocks, 32 for the 32-weight blocks, 0 for F16 / BF16 (activations not rounded)."""
    form = BLOCK_FORMATS[block_type]
    return 0 if form.values is not None else 256 if form.weights == 256 else 32


def block_linear(x: Tensor, blocks: Tensor, block_type: Q | int, bias: Tensor | None = None) -> Tensor:
    """x (M, K) float32, rounded as `block_type` multiplies it, @ w^T + bias, w (N, K) stored as
    `blocks` (N, K / W * Z) uint8 of `block_type` (a GGML type, or qkv's repacked Q4_K_X16 / Q5_K_X16 / Q8_0_X16:
    qkv.runtime.native.repacked); in the active variant (ops.use_variant caps it), exactly
    what qkv's whole-layer kernel computes for a block layer."""
    return torch.ops.qkv.block_linear.default(x, blocks, int(block_type), bias)


def block_decode(blocks: Tensor, block_type: Q, k: int) -> Tensor:
    """The (N, K) float32 weights of `blocks` (N, K / W * Z) as the C++ block table decodes them."""
    return torch.ops.qkv.block_decode.default(blocks, int(block_type), k)


def block_table() -> dict[Q, tuple[int, int, int]]:
    """The C++ block-format table (block_format.cpp): type -> (weights, bytes a block, activation step)."""
    rows = torch.ops.qkv.block_table.default(torch.empty(0)).tolist()
    return {Q(code): (weights, size, step) for code, weights, size, step in rows}


def rounded_activations(x: Tensor, block_type: Q) -> Tensor:
    """x (..., K) as the products for `block_type` round it, in float32: per activation_step
    inputs, step d = max|x| / 127 and x ~ d * round(x * (1 / d)), ties to even (step 0: x itself)."""
    step_size = activation_step(block_type)
    if step_size == 0:
        return x.float()
    groups = x.float().reshape(*x.shape[:-1], -1, step_size)  # (..., K / step, step)
    step = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (torch.round(groups * inverse) * step).reshape(x.shape)


@functools.cache
def register_fake() -> None:
    @torch.library.register_fake("qkv::block_linear")
    def _block_linear(x: Tensor, blocks: Tensor, block_type: int, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])


def product_bound(rounded: Tensor, w: Tensor, k: int, block_type: Q) -> Tensor:
    """How far a block product may lie from the exact product of the rounded activations
    (M, K) and the weights (N, K), both float64, relative to sum |x' w|: for a quantized type,
    float32 rounding of the per-block sums' combination, a few eps per block and per
    accumulation; for F16 / BF16 (whose every product and sum is a float32 one) a float32
    sum of K terms in order, (K + 8) eps (the bound of recursive summation, K u with u = eps / 2,
    twice over)."""
    plain = activation_step(block_type) == 0
    terms = k + 8 if plain else 2 * (k // 32 + 8)
    return terms * torch.finfo(torch.float32).eps * (rounded.abs() @ w.abs().t()) + 1e-30


def _self_test() -> str | None:
    """Every native type on a few random rows, in every variant, against the dequantized
    weights times the rounded activations (float64); None when all pass, else what failed."""
    from qkv.runtime.native.ops import use_variant, variants

    generator = torch.Generator().manual_seed(0)
    for block_type in sorted(NATIVE_TYPES, key=int):
        form = BLOCK_FORMATS[block_type]
        k = 2 * 256
        raw = torch.randint(0, 256, (5, k // form.weights, form.size), dtype=torch.uint8, generator=generator)
        for start in form.halves:  # finite, small float16 scales
            raw[:, :, start : start + 2] = (torch.rand(5, k // form.weights, 1, generator=generator) / 16).half().view(torch.uint8)
        if form.split_scale is not None:  # a scale in pieces (IQ1_M's d): a finite, small one too
            scales = (torch.rand(raw.shape[0] * raw.shape[1], generator=generator) / 16).half().view(torch.int16).numpy()
            flat = raw.reshape(-1, form.size).numpy()
            form.split_scale.write(flat, scales.view(np.uint16))
            raw = torch.from_numpy(flat).reshape(raw.shape)
        if form.values is not None:  # plain 16-bit values: finite ones
            raw = torch.randn(5, k // form.weights, form.weights, generator=generator).to(form.values).view(torch.uint8)
        blocks = raw.reshape(5, -1).contiguous()
        w = form.decode(raw.reshape(-1, form.size)).reshape(5, k).double()
        if not torch.equal(block_decode(blocks, block_type, k).double(), w):
            return f"the {block_type.name} block decode differs from the gguf library's"
        x = torch.randn(3, k, generator=generator)
        rounded = rounded_activations(x, block_type).double()
        expected, bound = rounded @ w.t(), product_bound(rounded, w, k, block_type)
        for variant in variants():
            with use_variant(variant):
                got = block_linear(x, blocks, block_type).double()
            if not bool(((got - expected).abs() <= bound).all()):
                return f"the {variant} {block_type.name} block product failed its self-test"
    return None


@functools.cache
def block_products_status() -> str | None:
    """None when `qkv::block_linear` is loaded and passed its self-test in this process, else
    why not (qkv.runtime.linear.block then runs its torch reference). Never raises."""
    from qkv.runtime.native.build import native_kernels

    status = native_kernels()
    if not status.available:
        return status.reason or "qkv's kernels are not loaded"
    if not hasattr(torch.ops.qkv, "block_decode"):
        return "the loaded kernels have no block products (an older build)"
    try:
        register_fake()
        return _self_test()
    except Exception as error:  # noqa: BLE001 - a library that loads but whose op fails
        lines = str(error).strip().splitlines()
        return f"the block products do not work: {lines[0][:160] if lines else type(error).__name__}"
