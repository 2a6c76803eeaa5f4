"""Every float a GGUF file's weights are made of checked finite, before anything is decoded.

A quantized block is integers times its float16 scale (`d`, and `dmin` or `m` for the types
with minimums): one NaN or infinite scale makes its 32 or 256 weights NaN, and a NaN weight
anywhere in a matrix spreads to every activation after it, so the model answers with empty
text and no error. The float checkpoints are refused for that (qkv.models.hf.checkpoint.
check_tensors); a file kept in blocks (the `blocks` precision) is never decoded as a whole,
so its scales are checked here instead: a float16 is NaN or infinite exactly when its five
exponent bits are all ones, one vectorised test on a strided view of each block's two bytes.
Plain F16, BF16 and F32 tensors are tested the same way, on every value.

The pass reads every page of the file (a block is smaller than a page), the cost of reading
the weights once; nothing is decoded or copied (measured on Gemma 3 270M Q4_K_M: see
tests/models/gguf/test_scales.py).

Shape legend: B blocks of a tensor, Z bytes a block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from qkv.errors import QkvError
from qkv.models.gguf.dequantize import BLOCK_FORMATS

# (bits, exponent mask, mantissa mask) of the plain float types: all exponent bits set is NaN
# (a mantissa) or infinity (none)
_PLAIN = {Q.F16: (np.dtype("<u2"), 0x7C00, 0x03FF), Q.BF16: (np.dtype("<u2"), 0x7F80, 0x007F),
          Q.F32: (np.dtype("<u4"), 0x7F800000, 0x007FFFFF)}
_F16 = _PLAIN[Q.F16]


def scale_names(tensor_type: Q) -> tuple[str, ...]:
    """The names llama.cpp gives a block's float16 fields, in BLOCK_FORMATS' `halves` order."""
    form = BLOCK_FORMATS[tensor_type]
    second = "dmin" if form.weights > 32 else "m"  # the K-quants' super-block minimum, the _1 types' minimum
    return ("d", second)[: len(form.halves)]


def _first_bad(bits: np.ndarray, exponent: int) -> int | None:
    """Index of the first value whose exponent bits are all set, or None."""
    bad = (bits & exponent) == exponent
    if not bad.any():
        return None
    return int(np.flatnonzero(bad)[0])


def _kind(value: int, mantissa: int) -> str:
    return "NaN" if value & mantissa else "infinite"


def check_finite(tensors: list[Any], path: Path) -> None:
    """Refuse the file if any block scale or plain float value of `tensors` (the header's
    GGUFTensor entries) is NaN or infinite, naming the tensor, the block and the field."""
    for tensor in tensors:
        plain = _PLAIN.get(tensor.tensor_type)
        if plain is not None:
            dtype, exponent, mantissa = plain
            values = np.asarray(tensor.data).reshape(-1).view(np.uint8).view(dtype)
            at = _first_bad(values, exponent)
            if at is not None:
                raise QkvError(f"{path}: tensor {tensor.name}: value {at} is {_kind(int(values[at]), mantissa)}; "
                               "the file is corrupt: download it again")
            continue
        form = BLOCK_FORMATS.get(tensor.tensor_type)
        if form is None:
            continue  # a type qkv decodes with the gguf library; checked as floats once decoded
        blocks = np.asarray(tensor.data).reshape(-1).view(np.uint8).reshape(-1, form.size)  # (B, Z)
        if form.split_scale is not None:  # a float16 stored in pieces (IQ1_M's d)
            bits = form.split_scale.read(blocks)  # (B,)
            at = _first_bad(bits, _F16[1])
            if at is not None:
                raise QkvError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}): block {at} has a "
                               f"{_kind(int(bits[at]), _F16[2])} float16 scale d; the file is corrupt: download it again")
        for start, field in zip(form.halves, scale_names(tensor.tensor_type)):
            scales = blocks[:, start : start + 2].view(_F16[0])[:, 0]  # (B,) a strided view, nothing copied
            at = _first_bad(scales, _F16[1])
            if at is not None:
                kind = _kind(int(scales[at]), _F16[2])
                raise QkvError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}): block {at} has a {kind} "
                               f"float16 scale {field}; the file is corrupt: download it again")
