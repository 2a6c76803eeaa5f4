"""A GGUF file's layers kept in the block types it stores, for the "blocks" precision.

A Q4_K_M file (what most GGUF users download) mixes Q4_K, Q6_K, Q5_0 and Q8_0 matrices.
Dequantizing them to float32 and quantizing again to int8 spends 8 bits a weight on numbers
that the file holds in 4.5-6.6, and runs on weights that are no longer the file's. Here each
projection becomes a `BlockLinear` over the file's own bytes (qkv.runtime.linear.block): every
product is the dequantized product up to float32 summation order, and a decode step streams
the file's bytes, not more. Stacked layers (q/k/v, gate/up: qkv.attention.stacking) hold
their parts' blocks, one block type each where they differ (`StackedBlockLinear`); qkv's
whole-layer kernel multiplies them as one product (runtime/native/csrc/kernels.h's BLOCKS Linear). The
embedding table stays in blocks too (`BlockEmbedding`: a lookup decodes only its rows), and a
tied output head reads the same blocks (where the head repacks them, the lookup reads the
head's copy: one table in memory).

    loaded = load_stored_blocks(opened)   # None when the file's layers are not all in block types

Shape legend: N output features (rows), K input features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from qkv.attention.stacking import stack_projections, stacked_from
from qkv.runtime.huge_pages import file_maps_fixed
from qkv.runtime.linear.block import block_embedding, stacked_block_linear
from qkv.runtime.stored_four_bits import EMBEDDING, fill_from_state, stacked_values, stored_parts

if TYPE_CHECKING:
    from qkv.models.gguf.stored import StoredBlocks
    from qkv.models.loader import LoadedModel, OpenedModel


def _bias(name: str, state: dict[str, Tensor], module: nn.Linear) -> Tensor | None | bool:
    """The stacked bias of layer `name` (None: it has none; False: a part's is missing)."""
    if module.bias is None:
        return None
    biases = [state.get(f"{part}.bias") for part in stacked_from(name)]
    return False if any(b is None for b in biases) else torch.cat([b for b in biases if b is not None]).float()


def use_file_blocks(model: nn.Module, state: dict[str, Tensor], blocks: dict[str, StoredBlocks]) -> bool:
    """Every linear layer of `model` (stacked already, parameters on the meta device) from the
    file's blocks where all its parts are stored so, else from `state` as float32; the embedding
    from its blocks where kept; the rest from `state`. In place; False when something has no
    source (the caller then prepares the usual way)."""
    tied = state.get(EMBEDDING)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        bias = _bias(name, state, module)
        if bias is False:
            return False
        parts = stored_parts(name, blocks)
        if parts and all(p.shape[1] == module.in_features for p in parts):
            model.set_submodule(name, stacked_block_linear(parts, bias if isinstance(bias, Tensor) else None))
            continue
        weight = stacked_values(name, state, blocks, tied)  # a matrix the file keeps as float values
        if weight is None:
            return False
        layer = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if isinstance(bias, Tensor):
            layer.bias = nn.Parameter(bias, requires_grad=False)
        model.set_submodule(name, layer)
    embedding = blocks.get(EMBEDDING)
    holder = EMBEDDING.removesuffix(".weight")
    if embedding is not None and isinstance(model.get_submodule(holder), nn.Embedding):
        tied = blocks.get("lm_head.weight") is embedding
        model.set_submodule(holder, block_embedding(embedding, model.get_submodule("lm_head") if tied else None, tied))
    return fill_from_state(model, state)


def load_stored_blocks(opened: OpenedModel) -> LoadedModel | None:
    """The model of a GGUF file whose layer matrices are all in block types, its projections
    and embedding kept as the file stores them; None for any other source."""
    source = opened.source
    if not getattr(source, "stored_in_blocks", False) or not hasattr(source, "read_stored"):
        return None
    stored = source.read_stored(torch.float32, embedding=True)
    loaded = opened.skeleton()
    loaded.model.eval()
    stack_projections(loaded.model)  # q/k/v and gate/up as one layer each, as every precision has them
    with torch.no_grad(), file_maps_fixed():  # the file is mapped already; nothing maps another
        if not use_file_blocks(loaded.model, stored.state, stored.blocks):
            return None
    return loaded
