"""`qkv::block_linear` (block_products.cpp) as a Python function, its fake implementation
(what torch.compile traces), and its own self-test, so that a library whose block products
compute wrong is never used for them.

The op multiplies float32 activations by a matrix kept in a GGUF block type, decoding each
weight row into the gguf library's float32 values: the result is the dequantized product up
to float32 summation order. Its summation order is one fixed order (block_products.cpp), the
same in the generic C++ and the AVX2 and AVX-512 variants and whatever the number of rows.

Shape legend: M rows of x, K inputs, N outputs.
"""

from __future__ import annotations

import functools

import torch
from gguf.constants import GGMLQuantizationType as Q
from torch import Tensor

# every block type qkv decodes (qkv.models.gguf.dequantize.BLOCK_FORMATS) has a native product
NATIVE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL})
ISAS = {"best": 0, "generic": 1, "avx2": 2, "avx512": 3}  # the op's `isa` argument


def block_linear(x: Tensor, blocks: Tensor, block_type: Q, bias: Tensor | None = None, isa: str = "best") -> Tensor:
    """x (M, K) float32 @ w^T + bias, w (N, K) stored as `blocks` (N, K / W * Z) uint8 of `block_type`."""
    return torch.ops.qkv.block_linear.default(x, blocks, int(block_type), bias, ISAS[isa])


def block_linear_q8(x: Tensor, blocks: Tensor, block_type: Q, bias: Tensor | None = None, isa: str = "best") -> Tensor:
    """The same product on x rounded per 32 inputs (block_q8.cpp: integer dot products), what
    qkv's whole-layer kernel runs for block layers on AVX-512 VNNI; isa "best", "generic" or
    "avx512"."""
    return torch.ops.qkv.block_linear_q8.default(x, blocks, int(block_type), bias, ISAS[isa])


def block_layer_linear(x: Tensor, blocks: Tensor, block_type: Q, bias: Tensor | None = None) -> Tensor:
    """What qkv's whole-layer kernel computes for a block layer: `block_linear_q8` where the active
    variant is AVX-512 VNNI, else `block_linear` (the modules call this, so both agree)."""
    return torch.ops.qkv.block_layer_linear.default(x, blocks, int(block_type), bias)


def layers_round_activations() -> bool:
    """Whether block layers run `block_linear_q8` here (the active variant is AVX-512 VNNI)."""
    return block_products_status() is None and torch.ops.qkv.active_variant.default() == "avx512"


def rounded_activations(x: Tensor) -> Tensor:
    """x (..., K) as block_linear_q8 rounds it, in float32: per 32 inputs, step d = max|x| / 127
    and x ~ d * round(x / d), ties to even (products.cpp's round_activations)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)  # (..., K / 32, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (torch.round(blocks * inverse) * step).reshape(x.shape)


def available_isas() -> list[str]:
    """The variants this CPU runs, generic first; none where the block products are not usable
    (block_products_status says why)."""
    return [] if block_products_status() is not None else _isas()


def _isas() -> list[str]:
    best = torch.ops.qkv.block_linear_best_isa.default(torch.empty(0))
    return [name for name, code in ISAS.items() if 1 <= code <= best]


@functools.cache
def register_fake() -> None:
    @torch.library.register_fake("qkv::block_linear")
    def _block_linear(x: Tensor, blocks: Tensor, block_type: int, bias: Tensor | None, isa: int) -> Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("qkv::block_layer_linear")
    def _block_layer_linear(x: Tensor, blocks: Tensor, block_type: int, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])


def _self_test() -> str | None:
    """Every native type on a few random rows against the dequantized product (float64), and
    every variant bit-identical to the generic one; None when all pass, else what failed."""
    from qkv.models.gguf import dequantize as gguf_blocks

    generator = torch.Generator().manual_seed(0)
    for block_type in sorted(NATIVE_TYPES, key=int):
        form = gguf_blocks.BLOCK_FORMATS[block_type]
        k = 2 * 256
        raw = torch.randint(0, 256, (5, k // form.weights, form.size), dtype=torch.uint8, generator=generator)
        for start in form.halves:  # finite, small float16 scales
            raw[:, :, start : start + 2] = (torch.rand(5, k // form.weights, 1, generator=generator) / 16).half().view(torch.uint8)
        blocks = raw.reshape(5, -1).contiguous()
        w = gguf_blocks.dequantize_blocks([blocks.numpy()], block_type).reshape(5, k).double()
        x = torch.randn(3, k, generator=generator)
        expected = x.double() @ w.t()
        bound = 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().t()) + 1e-30
        generic = block_linear(x, blocks, block_type, isa="generic")
        if not bool(((generic.double() - expected).abs() <= bound).all()):
            return f"the {block_type.name} block product's self-test failed"
        for isa in _isas()[1:]:
            if not torch.equal(block_linear(x, blocks, block_type, isa=isa), generic):
                return f"the {isa} {block_type.name} block product differs from the generic one"
        rounded = rounded_activations(x).double()  # the rounded-activation products, every variant
        expected, bound = rounded @ w.t(), 2 * k * torch.finfo(torch.float32).eps * (rounded.abs() @ w.abs().t()) + 1e-30
        vnni = "avx512" in torch.ops.qkv.variants.default().split(",")  # qkv's AVX-512 variant has VNNI
        for isa in ["generic", *(["avx512"] if vnni else [])]:
            got = block_linear_q8(x, blocks, block_type, isa=isa).double()
            if not bool(((got - expected).abs() <= bound).all()):
                return f"the {isa} {block_type.name} product on rounded activations failed its self-test"
    return None


@functools.cache
def block_products_status() -> str | None:
    """None when `qkv::block_linear` is loaded and passed its self-test in this process, else
    why not (qkv.runtime.linear.block then runs its torch reference). Never raises."""
    from qkv.runtime.native.build import native_kernels

    status = native_kernels()
    if not status.available:
        return status.reason or "qkv's kernels are not loaded"
    if not hasattr(torch.ops.qkv, "block_linear"):
        return "the loaded kernels have no block products (an older build)"
    try:
        register_fake()
        return _self_test()
    except Exception as error:  # noqa: BLE001 - a library that loads but whose op fails
        lines = str(error).strip().splitlines()
        return f"the block products do not work: {lines[0][:160] if lines else type(error).__name__}"
