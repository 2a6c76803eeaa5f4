"""A GGUF file's 4-bit matrices into qkv's int4 layers as stored: no float32 round trip.

qkv's `Int4Linear` holds GGUF's Q4_1 layout (per block of 32 weights: a float16 scale d, a
float16 minimum m, 16 bytes of nibbles, w = q * d + m), so a Q4_1 block is taken byte for
byte, and a Q4_0 block (w = (q - 8) * d) exactly as Q4_1 with m = -8 d (a float16 times 8 is
a float16, below the overflow no real scale reaches). Before, the loader dequantized every
matrix to float32 and the int4 layers fitted new blocks by min and max, losing precision a
second time wherever a block did not span all 16 levels; a prepared-weights cache hid the
cost of that round trip.

    loaded = load_stored_four_bits(opened)   # None when the file's layers are not all Q4_0/Q4_1

Stacked layers (q/k/v, a SwiGLU's gate and up: qkv.attention.stacking) concatenate the rows
of their parts' blocks. The output head (GGUF's Q4 files keep it at 8 bits, Q8_0, or Q6_K) is
the file's own blocks too (`BlockLinear`, multiplied by qkv's block products), the same bytes
as the embedding table when the two are tied: nothing is dequantized or re-quantized at load.
Where the block products cannot run, it is int8 quantized from its stored values. The
embedding table stays in the file's blocks
(`BlockEmbedding`: a lookup decodes only its rows, the gguf library's values), not float32:
SmolLM2's is 108 MiB as float32, more than the whole file's 94.

Shape legend: N output features (rows), K input features, G = K / 32 blocks per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from qkv.attention.stacking import stacked_from
from qkv.models.gguf.dequantize import Q
from qkv.runtime.linear.block import BlockLinear, block_embedding, native_reason
from qkv.runtime.linear.quantized import Int4Linear, Int8Linear, quantize_groups, quantize_rows

if TYPE_CHECKING:
    from qkv.models.gguf.stored import StoredBlocks
    from qkv.models.loader import LoadedModel, OpenedModel

FOUR_BITS = (Q.Q4_0, Q.Q4_1)
EMBEDDING = "model.embed_tokens.weight"


def four_bit_blocks(parts: list[StoredBlocks]) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_0 / Q4_1 matrices of one input size, their rows stacked in order, as Int4Linear's
    q (N, K/2) uint8, d (N, G) and m (N, G) float16 (each byte copied once)."""
    k = parts[0].shape[1]
    g, total = k // 32, sum(p.shape[0] for p in parts)
    q = torch.empty(total, g, 16, dtype=torch.uint8)  # (N, G, 16)
    d = torch.empty(total, g, 1, dtype=torch.float16)  # (N, G, 1)
    m = torch.empty(total, g, 1, dtype=torch.float16)
    row = 0
    for part in parts:
        n = part.shape[0]
        size = 18 if part.block_type == Q.Q4_0 else 20
        blocks = part.blocks.view(n, g, size)  # (n, G, bytes of a block)
        d[row:row + n] = blocks[..., 0:2].view(torch.float16)
        if part.block_type == Q.Q4_1:
            m[row:row + n] = blocks[..., 2:4].view(torch.float16)
            q[row:row + n] = blocks[..., 4:20]
        else:
            torch.mul(d[row:row + n], -8, out=m[row:row + n])  # exact: (q - 8) * d is q * d + (-8 d)
            q[row:row + n] = blocks[..., 2:18]
        row += n
    return q.view(total, g * 16), d.view(total, g), m.view(total, g)  # (N, K/2), (N, G), (N, G)


def stored_parts(name: str, blocks: dict[str, StoredBlocks]) -> list[StoredBlocks] | None:
    """The stored matrices of the prepared layer `name`, in row order: the file's own stacked
    matrix where it keeps one (Phi-3's qkv_proj, gate_up_proj), else each part's; None when a
    part is not stored as blocks."""
    whole = blocks.get(f"{name}.weight")
    if whole is not None:
        return [whole]
    parts = [blocks.get(f"{part}.weight") for part in stacked_from(name)]
    return None if any(p is None for p in parts) else [p for p in parts if p is not None]


def stacked_values(name: str, state: dict[str, Tensor], blocks: dict[str, StoredBlocks], tied: Tensor | None) -> Tensor | None:
    """The float32 weight of the prepared layer `name` (its parts' rows stacked, dequantized
    where they are stored as blocks), or None."""
    stored = blocks.get(f"{name}.weight")
    if stored is not None:  # stacked in the file already
        return stored.dequantize()
    pieces = []
    for part in stacked_from(name):
        weight = state.get(f"{part}.weight", tied if part == "lm_head" else None)  # a tied head: the embedding's values
        if weight is None and f"{part}.weight" in blocks:
            weight = blocks[f"{part}.weight"].dequantize()
        if weight is None:
            return None
        pieces.append(weight.float())
    return torch.cat(pieces)


def _fill(model: nn.Module, state: dict[str, Tensor], blocks: dict[str, StoredBlocks]) -> bool:
    """Every prepared layer from `blocks` (int4) or `state` (the head, norms, embeddings);
    False when something has no source (the caller then prepares the usual way)."""
    embedding = blocks.get(EMBEDDING)
    head = blocks.get("lm_head.weight", embedding if "lm_head.weight" not in state else None)  # a tied head: the table
    if head is not None and native_reason() is None and isinstance(model.get_submodule("lm_head"), Int8Linear):
        model.set_submodule("lm_head", BlockLinear(head))  # the file's blocks, multiplied as stored
    tied = state.get(EMBEDDING)  # what a tied head's rows are
    if tied is None and embedding is not None and isinstance(model.get_submodule("lm_head"), Int8Linear) \
            and "lm_head.weight" not in state and "lm_head.weight" not in blocks:
        tied = embedding.dequantize()  # only while the head is quantized from it
    for name, module in list(model.named_modules()):
        if isinstance(module, Int4Linear):
            parts = stored_parts(name, blocks)
            if parts and all(p.block_type in FOUR_BITS and p.shape[1] == module.in_features for p in parts):
                module.set_blocks(*four_bit_blocks(parts))  # rows of every part, in order
            else:  # a matrix stored otherwise (the tied head of a small model): fitted as before
                weight = stacked_values(name, state, blocks, tied)
                if weight is None:
                    return False
                module.set_blocks(*quantize_groups(weight))
        elif isinstance(module, Int8Linear):
            weight = stacked_values(name, state, blocks, tied)
            if weight is None:
                return False
            q, scales = quantize_rows(weight)
            module.weight, module.scales = q, scales.to(module.scales.dtype)
        else:
            continue
        if module.bias is not None:
            biases = [state.get(f"{part}.bias") for part in stacked_from(name)]
            if any(b is None for b in biases):
                return False
            module.bias = nn.Parameter(torch.cat(biases).to(module.bias.dtype), requires_grad=False)  # type: ignore[arg-type]
    holder = EMBEDDING.removesuffix(".weight")
    if embedding is not None and isinstance(model.get_submodule(holder), nn.Embedding):
        model.set_submodule(holder, block_embedding(embedding, model.get_submodule("lm_head"), head is embedding))
    return fill_from_state(model, state)


def fill_from_state(model: nn.Module, state: dict[str, Tensor]) -> bool:
    """Every parameter still on the meta device (norms, embeddings) from `state`, in place;
    False when one has no value there or anything is left on the meta device."""
    with torch.no_grad():
        for owner, holder in model.named_modules():
            for key, parameter in list(holder.named_parameters(recurse=False)):
                if parameter.is_meta:
                    value = state.get(f"{owner}.{key}" if owner else key)
                    if value is None:
                        return False
                    setattr(holder, key, nn.Parameter(value.to(parameter.dtype), requires_grad=False))
    return not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def load_stored_four_bits(opened: OpenedModel, shape_layers: object) -> LoadedModel | None:
    """The model of a GGUF file whose layer matrices are all Q4_0/Q4_1, prepared at int4 from
    its blocks as stored; None for any other source (prepare it the usual way).
    `shape_layers(model)` makes the prepared layers empty (qkv.runtime.prepare)."""
    source = opened.source
    if not getattr(source, "stored_in_four_bits", False) or not hasattr(source, "read_stored"):
        return None
    stored = source.read_stored(opened.plan.dtype, embedding=True)
    loaded = opened.skeleton()
    shape_layers(loaded.model)  # type: ignore[operator]
    with torch.no_grad():
        if not _fill(loaded.model, stored.state, stored.blocks):
            return None
    return loaded
