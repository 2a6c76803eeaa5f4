"""A GGUF file of block matrices written with the gguf package (random block bytes, a different
block type per matrix), for the tests of stored blocks and of the layers that multiply by them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from qkv.models.gguf import dequantize as gguf_blocks

HIDDEN, FF, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 3
# one block type per matrix, so that a mix-up of rows, types or names shows
LAYER_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q5_0, "attn_output": Q.Q8_0,
               "ffn_gate": Q.Q4_0, "ffn_up": Q.Q5_K, "ffn_down": Q.Q4_1}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN), "ffn_down": (HIDDEN, FF)}


def random_blocks(block_type: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """(N, bytes a row) uint8 of `block_type`: random bytes with finite float16 scales, or (F16,
    BF16) normal values."""
    form = gguf_blocks.BLOCK_FORMATS[block_type]
    if form.values is not None:
        values = torch.from_numpy(rng.normal(scale=0.05, size=shape).astype(np.float32))
        return values.to(form.values).view(torch.uint8).numpy()
    raw = rng.integers(0, 256, size=(shape[0] * shape[1] // form.weights, form.size), dtype=np.uint8)
    for start in form.halves:
        raw[:, start : start + 2] = rng.normal(scale=0.05, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if form.split_scale is not None:  # IQ1_M: d in pieces
        form.split_scale.write(raw, rng.normal(scale=0.05, size=raw.shape[0]).astype(np.float16).view(np.uint16))
    return raw.reshape(shape[0], -1)


def write_block_gguf(path: Path, *, tied: bool = True, embedding: Q = Q.Q6_K,
                     layer_types: dict[str, Q] | None = None) -> Path:
    """A one-layer llama GGUF whose matrices are random bytes of several block types (an F32
    embedding is written as float values)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    if embedding == Q.F32:
        writer.add_tensor("token_embd.weight", rng.normal(size=(VOCAB, HIDDEN)).astype(np.float32))
    else:
        writer.add_tensor("token_embd.weight", random_blocks(embedding, (VOCAB, HIDDEN), rng), raw_dtype=embedding)
    if not tied:
        writer.add_tensor("output.weight", random_blocks(Q.Q8_0, (VOCAB, HIDDEN), rng), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", rng.normal(size=HIDDEN).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.normal(size=HIDDEN).astype(np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", rng.normal(size=HIDDEN).astype(np.float32))
    for name, block_type in (LAYER_TYPES if layer_types is None else layer_types).items():
        if block_type in (Q.F32, Q.F16, Q.BF16):  # float values, as a file's unquantized matrices are
            values = rng.normal(scale=0.05, size=SHAPES[name]).astype(np.float32)
            if block_type == Q.BF16:  # numpy has no bfloat16: its bits are float32's upper half
                raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(SHAPES[name][0], -1)
                writer.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=Q.BF16)
            else:
                writer.add_tensor(f"blk.0.{name}.weight", values.astype(np.float16 if block_type == Q.F16 else np.float32))
            continue
        writer.add_tensor(f"blk.0.{name}.weight", random_blocks(block_type, SHAPES[name], rng), raw_dtype=block_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
