"""A linear layer that keeps a GGUF matrix as the file stores it and multiplies from the blocks.

    layer = block_linear_from_stored(stored)          # stored: qkv.models.gguf.stored.StoredBlocks
    y = layer(x)                                      # x (..., K) -> (..., N)

Holding the file's blocks (4.5 bits a weight for Q4_K, 6.6 for Q6_K) instead of float32
weights keeps memory and the bytes a decode step streams at the file's size, and runs on
exactly the weights llama.cpp runs on: no float32 round trip, no re-quantization (a Q4_0
block is multiplied as Q4_0, not re-fit). The product is what qkv's whole-layer kernel runs
for the layer (`qkv::block_linear`, qkv.runtime.native.block_ops): the activations are
rounded as the weight type multiplies them (per 32 inputs for 32-weight blocks, per 256 for
the K-quants, as llama.cpp rounds them) and the weights' codes meet them in exact integer
dot products, the same math on every CPU (runtime/native/csrc/block_format.h: the
dequantized weights times the rounded activations, up to float32 summation order). Each row
is computed in one fixed order whatever the batch, so a row's numbers do not depend on the
other rows. Where the native kernels are not available (no compiler, another CPU,
QKV_NATIVE=0, a failed self-test) the layer runs the torch reference, `F.linear` of the same
rounded activations and the dequantized weights (made once, on first use, and kept): the
same product up to summation order, more slowly, and said once on stderr.

Shape legend: N outputs (rows of the matrix), K inputs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.models.gguf.stored import StoredBlocks
from qkv.runtime.linear.kernel import kernel_list
from qkv.runtime.native.block_ops import block_linear, block_products_status, rounded_activations
from qkv.runtime.huge_pages import file_mapped_ranges, huge_empty, release_file_pages
from qkv.runtime.native.repacked import GROUP_ROWS, REPACKED, repack_into, repack_status, repackable, unrepack

MAX_STACKED_BLOCKS = 4  # runtime/native/csrc/kernels.h's MAX_PARTS: matrices of different block types in one product
_said: set[str] = set()


def native_reason() -> str | None:
    """None when the native block products run here, else why not (in a few words)."""
    return block_products_status()


class BlockLinear(nn.Module):
    """y = x @ w^T + bias with w (N, K) kept as GGUF blocks (`blocks` (N, bytes a row) uint8)."""

    def __init__(self, stored: StoredBlocks | Sequence[StoredBlocks], bias: Tensor | None = None, *,
                 native: bool | None = None) -> None:
        """`stored`: one matrix, or several of one block type and column count stacked by rows
        (q/k/v, gate/up). `native`: None runs the native product where it is available, False
        the torch reference always; True requires the native product (RuntimeError naming why not)."""
        super().__init__()
        parts = [stored] if isinstance(stored, StoredBlocks) else list(stored)
        first = parts[0]
        if any(p.block_type != first.block_type or p.shape[1] != first.shape[1] for p in parts):
            kinds = ", ".join(f"{p.block_type.name} {p.shape}" for p in parts)
            raise ValueError(f"only matrices of one block type and one column count stack by rows, got {kinds}")
        self.block_type = first.block_type
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), first.shape[1]
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for a layer of {self.out_features} outputs")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        reason = native_reason() if native is not False else "the torch reference was asked for"
        if native and reason is not None:
            raise RuntimeError(f"the native block product is not available: {reason}")
        self.native = reason is None
        if not self.native and native is None and reason not in _said:
            _said.add(reason)
            print(f"qkv: GGUF block layers run PyTorch's reference product ({reason})", file=sys.stderr)
        # Q4_K, Q5_K and Q8_0 in whole groups of 16 rows run repacked (qkv.runtime.native.repacked's AT_LOAD),
        # the same products faster; `stored` undoes it
        self.repacked = (self.native and all(repackable(p.block_type, p.shape[0]) for p in parts)
                         and repack_status() is None)
        self.register_buffer("blocks", _rows_of(parts, self.repacked))
        # the block type as qkv's whole-layer kernel reads it (runtime/native/csrc/kernels.h's Linear: [blocks, type])
        self.kernel_type = REPACKED[self.block_type] if self.repacked else int(self.block_type)
        self.register_buffer("type_code", torch.tensor([self.kernel_type], dtype=torch.int64), persistent=False)
        self._weight: Tensor | None = None  # the reference path's dequantized weights

    @property
    def stored(self) -> StoredBlocks:
        blocks = unrepack(self.blocks, self.block_type) if self.repacked else self.blocks
        return StoredBlocks(blocks, self.block_type, (self.out_features, self.in_features))

    def dequantized_weight(self) -> Tensor:
        """The (N, K) float32 weights, bit-identical to the gguf library's (kept once made)."""
        if self._weight is None:
            self._weight = self.stored.dequantize()
        return self._weight

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input of {x.shape[-1]} features for a layer of {self.in_features}")
        if not self.native:
            rounded = rounded_activations(x, self.block_type)
            return F.linear(rounded, self.dequantized_weight(), self.bias).to(x.dtype)
        rows = x.reshape(-1, self.in_features).float().contiguous()  # (..., K) -> (M, K)
        y = block_linear(rows, self.blocks, self.kernel_type, self.bias)  # (M, N)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def kernel_tensors(self) -> list[Tensor] | None:
        """[blocks, type, bias?] for qkv's whole-layer kernel (qkv.runtime.linear.kernel)."""
        return kernel_list([self.blocks, self.type_code], self.bias) if self.native else None

    def extra_repr(self) -> str:
        path = ("native, repacked" if self.repacked else "native") if self.native else "torch reference"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.block_type.name}, {path}"


def _rows_of(parts: list[StoredBlocks], repacked: bool) -> Tensor:
    """The parts' rows one after the other, repacked where asked, written once onto 2 MB pages
    (qkv.runtime.huge_pages), never into the parts (a part may be a view of the file's mapping);
    one part kept as stored is its own bytes (a tied head shares the embedding table's)."""
    if len(parts) == 1 and not repacked:
        return parts[0].blocks
    out = huge_empty(sum(p.blocks.shape[0] for p in parts), parts[0].blocks.shape[1])  # (N, bytes a row)
    row, files = 0, file_mapped_ranges()
    for part in parts:
        rows = part.blocks.shape[0]
        if repacked:
            repack_into(part.blocks, part.block_type, out[row : row + rows])
        else:
            out[row : row + rows].copy_(part.blocks)
        release_file_pages(part.blocks, files)  # copied: its file pages need not stay resident
        row += rows
    return out


class StackedBlockLinear(nn.Module):
    """Several stored matrices of different block types (a Q4_K_M file's q, k and v are Q5_0,
    Q5_0 and Q8_0) as one layer: their outputs one after the other, as the stacked matrix's,
    plus the stacked bias. qkv's whole-layer kernel runs the parts as one product (kernels.h's
    BLOCKS Linear)."""

    def __init__(self, parts: Sequence[StoredBlocks], bias: Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(BlockLinear(p) for p in parts)
        self.in_features, self.out_features = parts[0].shape[1], sum(p.shape[0] for p in parts)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for a layer of {self.out_features} outputs")
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @property
    def native(self) -> bool:
        return all(part.native for part in self.parts)  # type: ignore[union-attr]

    def kernel_tensors(self) -> list[Tensor] | None:
        """[blocks, type, (blocks, type)..., bias?] for qkv's whole-layer kernel, which takes up
        to MAX_STACKED_BLOCKS parts (qkv.runtime.linear.kernel)."""
        if not self.native or len(self.parts) > MAX_STACKED_BLOCKS:
            return None
        return kernel_list([t for part in self.parts for t in (part.blocks, part.type_code)], self.bias)  # type: ignore[union-attr]

    def forward(self, x: Tensor) -> Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)  # (..., N_0 + N_1 + ...)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class BlockEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks (Gemma 3's 262,144 x 640 table is 178 MB as Q8_0
    and 671 MB as float32): a lookup decodes only the rows it gathers, with the gguf library's
    float32 values (qkv.models.gguf.dequantize), so it equals nn.Embedding over the dequantized table.
    `BlockEmbedding.tied_to(head)` reads a tied output head's repacked table instead of the
    file's (one copy of the table in memory, not two): each id's group of 16 rows is put back
    in the file's layout (a lossless permutation) and its row decoded, the same values.

    ids (...) -> (..., C)."""

    def __init__(self, stored: StoredBlocks) -> None:
        super().__init__()
        self.block_type = stored.block_type
        self.num_embeddings, self.embedding_dim = stored.shape
        self.repacked = False  # blocks in REPACKED[block_type]'s layout (a tied head's), not the file's
        self.register_buffer("blocks", stored.blocks)

    @classmethod
    def tied_to(cls, head: BlockLinear) -> BlockEmbedding:
        """The table a tied output head multiplies, looked up from the head's own blocks."""
        table = cls(StoredBlocks(head.blocks, head.block_type, (head.out_features, head.in_features)))
        table.repacked = head.repacked
        return table

    def forward(self, ids: Tensor) -> Tensor:
        from qkv.models.gguf.dequantize import BLOCK_FORMATS

        form = BLOCK_FORMATS[self.block_type]
        rows = self._file_rows(ids.reshape(-1))  # (n, bytes a row)
        values = form.decode(rows.view(-1, form.size))  # (n * K / W, W)
        return values.reshape(*ids.shape, self.embedding_dim)  # (..., C)

    def _file_rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` (n,) of the table as the file stores them (n, bytes a row)."""
        if not self.repacked:
            return self.blocks.index_select(0, ids)
        row_bytes = self.blocks.shape[1]
        groups = self.blocks.view(-1, GROUP_ROWS * row_bytes).index_select(0, ids // GROUP_ROWS)  # (n, 16 * bytes a row)
        rows = unrepack(groups.view(-1, row_bytes), self.block_type).view(-1, GROUP_ROWS, row_bytes)  # (n, 16, bytes a row)
        return rows[torch.arange(len(ids)), ids % GROUP_ROWS]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.block_type.name}" + (", repacked" if self.repacked else "")


def block_embedding(stored: StoredBlocks, head: nn.Module | None, tied: bool) -> BlockEmbedding:
    """The embedding table's lookup: from a tied output head's blocks where it holds the table
    repacked (the file's rows would be a second copy), else from the file's blocks."""
    if tied and isinstance(head, BlockLinear) and head.repacked and head.block_type == stored.block_type:
        return BlockEmbedding.tied_to(head)
    return BlockEmbedding(stored)


def stacked_block_linear(parts: Sequence[StoredBlocks], bias: Tensor | None = None) -> nn.Module:
    """One layer for matrices stacked by rows (stacked q/k/v, gate/up): their rows of blocks
    concatenated when they share a block type, else a StackedBlockLinear; columns must agree."""
    if any(p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError(f"stacked matrices need one column count, got {[p.shape for p in parts]}")
    if all(p.block_type == parts[0].block_type for p in parts):
        return BlockLinear(parts, bias)
    return StackedBlockLinear(parts, bias)
