"""Each rank reads its slice of every tensor straight from the file, never the whole model.

A rank's slice of a tensor is some of its rows (q/k/v, gate/up, the vocabulary's rows of the
embedding and head) or some of its columns (o_proj, down_proj), or all of it (norms). In a GGUF
file a row is whole blocks, so a stretch of rows is one contiguous run of bytes, read with one
`preadv`; a stretch of columns is the same run of bytes in every row, read row by row, and is
still whole blocks when its ends are multiples of the block's weights. Then the slice stays in
blocks (`StoredBlocks`, for the blocks and int4 precisions) or is decoded. A column slice whose
ends fall inside a block (a K-quant's 256 weights against an o_proj slice of 3 x 64 columns)
reads the blocks that cover it, decodes just those and cuts the columns out: that tensor is
then float32 on this rank, whatever the precision keeps of the others. Reads go through
`preadv` into the rank's own buffers, not through the file's memory map, so a rank's resident
memory is its slices, not the pages of the whole file.

Checkpoint folders (safetensors) are read with `safe_open(...).get_slice`, which copies just
the slice.

Shape legend: R rows of a tensor, K its columns, W weights a block, Z bytes a block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from safetensors import safe_open
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf.layout import gguf_shape, unpermute_rows
from qkv.models.gguf.scales import check_finite
from qkv.models.gguf.stored import StoredBlocks


@dataclass(frozen=True)
class TensorSlice:
    """Rows and columns of a 2-D tensor (None: all); a 1-D tensor has rows only."""

    rows: range | None = None
    cols: range | None = None


@dataclass(frozen=True)
class _Bytes:
    """A slice's raw bytes, shaped as check_finite reads a header's tensors."""

    name: str
    tensor_type: Q
    data: np.ndarray


class GGUFSlices:
    """Slices of one GGUF file's tensors, read with preadv (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def _read(self, buffer: np.ndarray, offset: int) -> None:
        view = memoryview(buffer.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise QkvError(f"{self.path} ended early while reading a slice; download it again")
            done += got

    def raw(self, tensor: Any, part: TensorSlice) -> tuple[np.ndarray, int, int]:
        """The bytes of the blocks covering `part` of `tensor`, (R', Z * blocks), with the
        columns they cover decoded: (bytes, first covered column, covered columns)."""
        shape = gguf_shape(tensor)
        rows_total = shape[0] if len(shape) == 2 else 1
        cols_total = shape[-1]
        weights, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        row_bytes = tensor.n_bytes // rows_total
        rows = part.rows if part.rows is not None else range(rows_total)
        cols = part.cols if part.cols is not None else range(cols_total)
        if len(shape) == 1:  # a vector: its elements are its "columns"
            rows, cols = range(1), rows if part.rows is not None else range(cols_total)
        if rows.stop > rows_total or cols.stop > cols_total or not (rows and cols):
            raise ValueError(f"{tensor.name}: rows {rows} and columns {cols} are not inside its {shape}")
        first, last = cols.start // weights, -(-cols.stop // weights)  # covering blocks
        width = (last - first) * size
        out = np.empty((len(rows), width), dtype=np.uint8)
        if width == row_bytes:
            self._read(out, tensor.data_offset + rows.start * row_bytes)
        else:
            for index, row in enumerate(rows):
                self._read(out[index], tensor.data_offset + row * row_bytes + first * size)
        return out, first * weights, (last - first) * weights

    def read(self, tensor: Any, part: TensorSlice, *, keep_blocks: bool, rope_heads: int | None,
             shift: float = 0.0) -> Tensor | StoredBlocks:
        """`part` of `tensor` in Hugging Face form: q/k rows put back in rotate-half order (over the
        slice's `rope_heads` heads), Gemma's norm `shift` taken off; as `StoredBlocks` when
        `keep_blocks`, the type is a block type and the columns are whole blocks, else float32."""
        raw, start, covered = self.raw(tensor, part)
        if rope_heads is not None:
            order = unpermute_rows(torch.arange(raw.shape[0])[:, None], rope_heads)[:, 0].numpy()
            raw = np.ascontiguousarray(raw[order])
        check_finite([_Bytes(tensor.name, tensor.tensor_type, raw)], self.path)
        shape = gguf_shape(tensor)
        cols = part.cols if part.cols is not None else range(shape[-1])
        if len(shape) == 1 and part.rows is not None:
            cols = part.rows
        aligned = cols.start == start and len(cols) == covered
        if keep_blocks and aligned and len(shape) == 2 and gguf_blocks.whole_blocks(tensor.tensor_type, covered):
            return StoredBlocks(torch.from_numpy(raw), tensor.tensor_type, (raw.shape[0], covered))
        if tensor.tensor_type in gguf_blocks.TYPES:
            values = gguf_blocks.dequantize_blocks([raw], tensor.tensor_type).view(raw.shape[0], covered)
        else:
            try:
                values = torch.from_numpy(np.array(gguf.quants.dequantize(raw, tensor.tensor_type), dtype=np.float32))
            except NotImplementedError:
                raise QkvError(f"{self.path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, a type "
                               "qkv cannot decode") from None
            values = values.reshape(raw.shape[0], covered)
        if not aligned:
            values = values[:, cols.start - start: cols.start - start + len(cols)]
        values = values.float().contiguous()
        if shift:
            values = values - shift
        return values.reshape(-1) if len(shape) == 1 else values


def read_safetensors_slice(path: Path, name: str, part: TensorSlice) -> Tensor:
    """`part` of tensor `name` of a safetensors file, copied (only the slice is read)."""
    with safe_open(str(path), framework="pt") as handle:
        view = handle.get_slice(name)
        rank = len(view.get_shape())
        rows = slice(None) if part.rows is None else slice(part.rows.start, part.rows.stop)
        if rank == 1:
            return view[rows].clone()
        cols = slice(None) if part.cols is None else slice(part.cols.start, part.cols.stop)
        return view[rows, cols].clone()
