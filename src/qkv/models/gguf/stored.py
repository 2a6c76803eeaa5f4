"""GGUF matrices handed over as they are stored: raw blocks, their type and their shape.

Dequantizing a Q4_K matrix to float32 and quantizing it again for a 4-bit kernel loses
precision (a min/max re-fit is not the file's fit) and time on every load. `StoredBlocks` keeps
the file's bytes instead, so that a kernel that reads the block layout (qkv.runtime.linear.block)
runs on exactly the weights llama.cpp runs on. `read_stored_state` reads a file that way: the
projection matrices of the layers (and the output head) as `StoredBlocks`, everything else
dequantized as `read_state_dict` gives it.

Rows are in Hugging Face order: the q/k rows that llama.cpp permuted are put back by moving
rows of bytes (a row of a GGUF matrix is whole blocks), so `StoredBlocks.dequantize()` equals
`read_state_dict`'s tensor bit for bit.

Shape legend: N rows (output features), K columns (input features), W weights a block,
Z bytes a block; a row is K / W blocks of Z bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf import arch as gguf_arch
from qkv.models.gguf.layout import gguf_shape, rope_heads, rows_in_hf_order
from qkv.models.gguf.tensors import read_state_dict

_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                "qkv_proj.weight", "gate_up_proj.weight")  # Phi-3 stores these two stacked


@dataclass(frozen=True)
class StoredBlocks:
    """One (N, K) matrix in a GGUF block type, as the file stores it: `blocks` (N, K / W * Z)
    uint8, row n holding the blocks of weights n, 0..K-1 in order."""

    blocks: Tensor
    block_type: Q
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        form = gguf_blocks.BLOCK_FORMATS.get(self.block_type)
        if form is None:
            raise ValueError(f"{self.block_type.name} is not a block type qkv reads; it reads {', '.join(names())}")
        rows, cols = self.shape
        if rows < 1 or cols < 1 or cols % form.weights:
            raise ValueError(f"a {self.block_type.name} matrix needs columns in whole blocks of {form.weights}, got {self.shape}")
        wanted = (rows, cols // form.weights * form.size)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != wanted or not self.blocks.is_contiguous():
            raise ValueError(f"{self.block_type.name} blocks of a {self.shape} matrix must be contiguous uint8 {wanted}, "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def bits_per_weight(self) -> float:
        form = gguf_blocks.BLOCK_FORMATS[self.block_type]
        return 8 * form.size / form.weights

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) weights the blocks stand for (bit-identical to the gguf library's)."""
        return gguf_blocks.dequantize_blocks([self.blocks.numpy()], self.block_type).reshape(self.shape).to(dtype)


def names() -> list[str]:
    return [t.name for t in sorted(gguf_blocks.BLOCK_FORMATS, key=int)]


def is_projection(name: str) -> bool:
    """Whether the Hugging Face tensor `name` is a matrix that a linear layer multiplies by
    (the layers' projections and the output head; not the embedding table, which is gathered)."""
    return name == "lm_head.weight" or (name.startswith("model.layers.") and name.endswith(_PROJECTIONS))


@dataclass(frozen=True)
class StoredState:
    """A GGUF file's tensors: `blocks` for the stored matrices, `state` for the rest (dequantized).

    With tied embeddings (`config["tie_word_embeddings"]`) the file has no output matrix and
    `blocks["lm_head.weight"]` holds the embedding table's blocks (the output product reads
    them; `state["model.embed_tokens.weight"]` is that table dequantized, for the lookup, unless
    `keep` takes the table too: then `blocks["model.embed_tokens.weight"]` is the same blocks).
    """

    state: dict[str, Tensor]
    blocks: dict[str, StoredBlocks]


def read_stored_state(
    reader: Any, config: dict[str, Any], path: Path, dtype: torch.dtype,
    keep: Callable[[str], bool] = is_projection,
) -> StoredState:
    """Every tensor of the file: those whose name `keep` accepts and whose type is a block
    type as `StoredBlocks` (rows in Hugging Face order), the others as read_state_dict gives them."""
    stored: dict[str, StoredBlocks] = {}
    arch = gguf_arch.architecture(reader, path)
    for tensor in arch.weights(reader.tensors):
        name = arch.hf_name(tensor.name)
        if arch.is_transposed(tensor.name, len(tensor.shape)):  # GPT-2's Conv1D layout: read as values
            continue
        tied_head = name == "model.embed_tokens.weight" and config.get("tie_word_embeddings")
        # (GGUF lists the row length first; an F16 row that is not whole 32s is read as values)
        if len(tensor.shape) != 2 or not gguf_blocks.whole_blocks(tensor.tensor_type, int(tensor.shape[0])):
            continue
        target = "lm_head.weight" if tied_head else name
        if name is None or not keep(target):
            continue
        shape = gguf_shape(tensor)
        raw = np.ascontiguousarray(rows_in_hf_order(np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1),
                                                     rope_heads(name, config, arch)))
        try:
            # a view of the file's copy-on-write mapping where the rows are the file's (no read, no
            # copy: qkv.models.gguf.header); permuted q/k rows are a copy already; a read-only
            # buffer (another reader) is copied, as torch needs writable memory
            blocks = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
            stored[target] = StoredBlocks(blocks, tensor.tensor_type, shape)
        except ValueError as error:
            raise QkvError(f"{path}: tensor {tensor.name}: {error}") from None
        if tied_head and keep(name):  # the lookup reads the same blocks as the head
            stored[name] = stored[target]
    skip = frozenset(name for name in stored if name != "lm_head.weight" or "lm_head.weight" in _file_names(reader, arch))
    return StoredState(read_state_dict(reader, config, path, dtype, skip=skip), stored)


def _file_names(reader: Any, arch: gguf_arch.Architecture) -> set[str | None]:
    return {arch.hf_name(t.name) for t in arch.weights(reader.tensors)}
