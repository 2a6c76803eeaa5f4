"""Matrices repacked at load into qkv's interleaved layouts (runtime/native/csrc/repacked/):
Q4_K -> Q4_K_X16 and Q5_K -> Q5_K_X16 (q4k.h: one layout, Q5_K's fifth bits after Q4_K's bytes,
one set of kernels), Q8_0 -> Q8_0_X16 and Q5_0 -> Q5_0_X16 (q8_0.h: one set of kernels, Q5_0's
nibbles and fifth bits where Q8_0 has its bytes), IQ4_XS -> IQ4_XS_X16 (iq4xs.h) and, on an
AVX-512 CPU, Q6_K -> Q6_K_X16 (q6k.h): groups of 16 rows
interleaved 4 bytes at a time, each block's scales side by side, so a decode step's product
runs a row of the group per SIMD lane (one 64-byte load is 4 or 8 weights of 16 rows) and a
prompt's product reads each weight block once per 4 activation rows.

The repacking is a byte permutation into a copy (`unrepack` gives the file's bytes back; the
file's mapping is never written), and the product is the same math as `qkv::block_linear` on
the file's blocks: the dequantized weights times the activations rounded as the file's type
meets them (per 256 for the K-quants, per 32 for Q8_0), every integer sum exact. Each output is
the same float operations in every variant (generic C++, AVX2, AVX-512: the same bits) and
whatever the number of activation rows (batch invariance); Q8_0_X16's, Q5_0_X16's, IQ4_XS_X16's
and Q6_K_X16's are the generic C++ stored product's own operations, so their results are that
product's bits.

Shape legend: N outputs (a multiple of 16), K inputs, M activation rows, W weights and Z bytes a block.
"""

from __future__ import annotations

import functools

import torch
from gguf.constants import GGMLQuantizationType as Q
from torch import Tensor

from qkv.models.gguf.dequantize import BLOCK_FORMATS
from qkv.runtime.native.block_ops import block_linear, block_products_status, product_bound, rounded_activations

Q4_K_X16 = 1012  # block_format.h's type ids of the repacked layouts (not GGML types)
Q5_K_X16 = 1013
Q8_0_X16 = 1008
Q5_0_X16 = 1006
IQ4_XS_X16 = 1023
Q6_K_X16 = 1014
REPACKED: dict[Q, int] = {Q.Q4_K: Q4_K_X16, Q.Q5_K: Q5_K_X16, Q.Q8_0: Q8_0_X16, Q.Q5_0: Q5_0_X16,
                          Q.IQ4_XS: IQ4_XS_X16, Q.Q6_K: Q6_K_X16}  # the file's type -> its layout
_OPS = {Q.Q4_K: "q4k", Q.Q5_K: "q5k", Q.Q8_0: "q8_0", Q.Q5_0: "q5_0", Q.IQ4_XS: "iq4xs", Q.Q6_K: "q6k"}
GROUP_ROWS = 16
# the types BlockLinear repacks at load (Q4_K_X16, Q5_K_X16 and Q8_0_X16 measured faster than the
# file's rows in a decode step and in a prefill, benchmarks/kernels/block_types.py: Q8_0_X16 on
# one thread 1.5-1.9x at a decode step of Gemma 3's 262144 x 640 head, 2.0-3.5x at 8192 x 2048,
# 1.3-1.8x in a 64- or 128-row prefill of a 1B model's shapes on AVX-512, about even at K = 640
# (machine shared, load 6-9, 2026-12-03)).
# Q5_0 -> Q5_0_X16 (Q8_0_X16's layout and kernels with Q5_0's nibbles and fifth bits): the
# stored rows' one-row kernel unpacks each block per activation row, and their prompt tiles put
# activation rows in 16 lanes, so 4 to 16 rows (a server's decode step, a short prompt) cost
# as much as 16. Measured (2 threads, Zen 4, 2026-12-07; /tmp scripts recorded in
# benchmarks/HISTORY.md, stop 47): 2048 x 640 in cache, rows / X16 time 2.4x at 1 row, 3.4x
# at 8, 2.3x at 32; 16384 x 2048 out of cache, one row, 2.7-5.2x; Gemma 3 270M Q4_K_M (its
# layers Q5_0) decoded at 83-97 tokens/s instead of 69-75 and prefilled 512 tokens at 856-903
# instead of 646-666.
# IQ4_XS -> IQ4_XS_X16 (Q4_K_X16's shape: the nibbles' code book values looked up 16 at a time,
# each 32-weight group's exact sum times its scale): 2.0-5.8x the file's rows for 1 to 32
# activation rows in cache, 1.2x out of cache (benchmarks/HISTORY.md, stop 47).
AT_LOAD: tuple[Q, ...] = (Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q5_0, Q.IQ4_XS)
# Q6_K -> Q6_K_X16 (q6k.h: Q4_K_X16's shape, the 6-bit codes unsigned against -32 s per 16 weights)
# only where the products run the AVX-512 kernels: there, 1 thread, 512 activation rows, 1.4-1.5x
# the stored rows' prompt tiles (113 against 78 GMAC/s); one row, read in order a chunk at a time,
# 1.5-1.6x the stored rows in cache and within the machine's noise of them out of cache; on AVX2
# its one-row kernel is 0.65x the stored rows' (their prompt products about even), so an AVX2 CPU
# keeps the file's rows (Zen 4, 2026-12-07; benchmarks/HISTORY.md, stops 48 and 50).
WITH_AVX512: tuple[Q, ...] = (Q.Q6_K,)


def repackable(block_type: Q, rows: int) -> bool:
    """Whether BlockLinear repacks a matrix of `rows` outputs in `block_type` (AT_LOAD's types,
    and WITH_AVX512's on a CPU that runs the AVX-512 kernels, in whole groups of 16)."""
    if block_type in WITH_AVX512:
        return rows % GROUP_ROWS == 0 and rows > 0 and _runs_avx512()
    return block_type in AT_LOAD and rows % GROUP_ROWS == 0 and rows > 0


def _runs_avx512() -> bool:
    """Whether the products run the AVX-512 kernels now: the CPU has them and no cap
    (`use_variant`, a benchmark's --variant avx2) keeps them off."""
    from qkv.runtime.native.ops import active_variant

    return block_products_status() is None and active_variant() == "avx512"


def repack(blocks: Tensor, block_type: Q) -> Tensor:
    """The file's rows (N, K / W * Z) uint8 of `block_type`, N a multiple of 16 -> a copy in
    REPACKED[block_type]'s layout, the same shape."""
    return getattr(torch.ops.qkv, f"{_OPS[block_type]}_repack").default(blocks)


def repack_into(blocks: Tensor, block_type: Q, out: Tensor) -> Tensor:
    """`repack(blocks, block_type)` written into `out` (the same shape; a slice of a stacked
    matrix), which is returned."""
    return getattr(torch.ops.qkv, f"{_OPS[block_type]}_repack_into").default(blocks, out)


def unrepack(packed: Tensor, block_type: Q) -> Tensor:
    """REPACKED[block_type]'s layout (N, K / W * Z) uint8 -> the file's rows of `block_type`."""
    return getattr(torch.ops.qkv, f"{_OPS[block_type]}_unrepack").default(packed)


def random_rows(block_type: Q, rows: int, k: int, generator: torch.Generator) -> Tensor:
    """(rows, K / W * Z) uint8 of random `block_type` blocks with small finite float16 scales."""
    form = BLOCK_FORMATS[block_type]
    raw = torch.randint(0, 256, (rows, k // form.weights, form.size), dtype=torch.uint8, generator=generator)
    for start in form.halves:
        raw[:, :, start : start + 2] = (torch.rand(rows, k // form.weights, 1, generator=generator) / 16).half().view(torch.uint8)
    return raw.reshape(rows, -1).contiguous()


def _self_test(block_type: Q) -> str | None:
    """A few groups in every variant: the repacking undone gives the bytes back, the product lies
    within the float bound of the dequantized weights times the rounded activations, and every
    variant and every row count gives the same bits. None when all pass, else what failed."""
    from qkv.runtime.native.ops import use_variant, variants

    generator = torch.Generator().manual_seed(0)
    k, name, code = 512, block_type.name, REPACKED[block_type]
    blocks = random_rows(block_type, 2 * GROUP_ROWS, k, generator)
    packed = repack(blocks, block_type)
    if not torch.equal(unrepack(packed, block_type), blocks):
        return f"the {name} repacking does not give the file's bytes back"
    form = BLOCK_FORMATS[block_type]
    w = form.decode(blocks.reshape(-1, form.size)).reshape(-1, k).double()
    x = torch.randn(5, k, generator=generator)
    rounded = rounded_activations(x, block_type).double()
    expected, bound = rounded @ w.t(), product_bound(rounded, w, k, block_type)
    first = None
    for variant in variants():
        with use_variant(variant):
            got = block_linear(x, packed, code)
            one = torch.cat([block_linear(x[m : m + 1], packed, code) for m in range(len(x))])
        if not bool(((got.double() - expected).abs() <= bound).all()):
            return f"the {variant} repacked {name} product failed its self-test"
        first = got if first is None else first
        if not (torch.equal(got, one) and torch.equal(got, first)):
            return f"the {variant} repacked {name} product differs between variants or row counts"
    return None


@functools.cache
def repack_status() -> str | None:
    """None when the repacked products are loaded and passed their self-tests, else why not
    (BlockLinear then keeps the file's rows). Never raises."""
    reason = block_products_status()
    if reason is not None:
        return reason
    if not all(hasattr(torch.ops.qkv, f"{op}_repack") for op in _OPS.values()):
        return "the loaded kernels have no repacked products (an older build)"
    try:
        for block_type in REPACKED:
            reason = _self_test(block_type)
            if reason is not None:
                return reason
        return None
    except Exception as error:  # noqa: BLE001 - a library that loads but whose op fails
        lines = str(error).strip().splitlines()
        return f"the repacked products do not work: {lines[0][:160] if lines else type(error).__name__}"
