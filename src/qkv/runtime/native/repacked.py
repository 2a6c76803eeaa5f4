"""Q4_K matrices repacked at load into qkv's Q4_K_X16 layout (runtime/native/csrc/repacked/q4k.h):
groups of 16 rows interleaved 4 bytes at a time, each super-block's scales side by side, so a
decode step's product runs a row of the group per SIMD lane (one 64-byte load is 8 weights of
16 rows) and a prompt's product reads each weight block once per 4 activation rows.

The repacking is a byte permutation (`unrepack_q4_k` gives the file's bytes back), and the
product is the same math as `qkv::block_linear` on the file's Q4_K blocks: the dequantized
weights times the activations rounded per 256, every integer sum exact. Each output is the
same float operations in every variant (generic C++, AVX2, AVX-512: the same bits) and
whatever the number of activation rows (batch invariance).

Shape legend: N outputs (a multiple of 16), K inputs, M activation rows.
"""

from __future__ import annotations

import functools

import torch
from gguf.constants import GGMLQuantizationType as Q
from torch import Tensor

from qkv.models.gguf.dequantize import BLOCK_FORMATS
from qkv.runtime.native.block_ops import block_linear, block_products_status, product_bound, rounded_activations

Q4_K_X16 = 1012  # block_format.h's type id of the repacked layout (not a GGML type)
GROUP_ROWS = 16


def repackable(block_type: Q, rows: int) -> bool:
    """Whether a matrix of `rows` outputs in `block_type` is repacked (Q4_K in whole groups)."""
    return block_type == Q.Q4_K and rows % GROUP_ROWS == 0 and rows > 0


def repack_q4_k(blocks: Tensor) -> Tensor:
    """Q4_K rows (N, K / 256 * 144) uint8, N a multiple of 16 -> the same bytes as Q4_K_X16."""
    return torch.ops.qkv.q4k_repack.default(blocks)


def unrepack_q4_k(packed: Tensor) -> Tensor:
    """Q4_K_X16 (N, K / 256 * 144) uint8 -> the file's Q4_K rows."""
    return torch.ops.qkv.q4k_unrepack.default(packed)


def random_q4_k(rows: int, k: int, generator: torch.Generator) -> Tensor:
    """(rows, K / 256 * 144) uint8 of random Q4_K blocks with small finite float16 scales."""
    form = BLOCK_FORMATS[Q.Q4_K]
    raw = torch.randint(0, 256, (rows, k // 256, form.size), dtype=torch.uint8, generator=generator)
    for start in form.halves:
        raw[:, :, start : start + 2] = (torch.rand(rows, k // 256, 1, generator=generator) / 16).half().view(torch.uint8)
    return raw.reshape(rows, -1).contiguous()


def _self_test() -> str | None:
    """A few groups in every variant: the repacking undone gives the bytes back, the product lies
    within the float bound of the dequantized weights times the rounded activations, and every
    variant and every row count gives the same bits. None when all pass, else what failed."""
    from qkv.runtime.native.ops import use_variant, variants

    generator = torch.Generator().manual_seed(0)
    k = 512
    blocks = random_q4_k(2 * GROUP_ROWS, k, generator)
    packed = repack_q4_k(blocks)
    if not torch.equal(unrepack_q4_k(packed), blocks):
        return "the Q4_K repacking does not give the file's bytes back"
    w = BLOCK_FORMATS[Q.Q4_K].decode(blocks.reshape(-1, 144)).reshape(-1, k).double()
    x = torch.randn(5, k, generator=generator)
    rounded = rounded_activations(x, Q.Q4_K).double()
    expected, bound = rounded @ w.t(), product_bound(rounded, w, k)
    first = None
    for variant in variants():
        with use_variant(variant):
            got = block_linear(x, packed, Q4_K_X16)
            one = torch.cat([block_linear(x[m : m + 1], packed, Q4_K_X16) for m in range(len(x))])
        if not bool(((got.double() - expected).abs() <= bound).all()):
            return f"the {variant} repacked Q4_K product failed its self-test"
        first = got if first is None else first
        if not (torch.equal(got, one) and torch.equal(got, first)):
            return f"the {variant} repacked Q4_K product differs between variants or row counts"
    return None


@functools.cache
def repack_status() -> str | None:
    """None when the Q4_K_X16 products are loaded and passed their self-test, else why not
    (BlockLinear then keeps the file's Q4_K rows). Never raises."""
    reason = block_products_status()
    if reason is not None:
        return reason
    if not hasattr(torch.ops.qkv, "q4k_repack"):
        return "the loaded kernels have no repacked Q4_K products (an older build)"
    try:
        return _self_test()
    except Exception as error:  # noqa: BLE001 - a library that loads but whose op fails
        lines = str(error).strip().splitlines()
        return f"the repacked Q4_K products do not work: {lines[0][:160] if lines else type(error).__name__}"
