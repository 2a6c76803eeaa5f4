"""A GGUF file of Q4_0/Q4_1 layers prepared at int4 from its blocks as stored: every int4
layer holds exactly the file's weights (Q4_0 too, as Q4_1 with m = -8 d), stacked layers the
rows of their parts in order, with no float32 round trip and no prepared cache."""

from __future__ import annotations

from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as Q

from qkv.models.gguf.checkpoint import open_gguf_file
from qkv.runtime.linear.block import BlockEmbedding, BlockLinear, native_reason
from qkv.runtime.linear.quantized import Int4Linear, Int8Linear
from qkv.runtime.prepare import prepare
from qkv.attention.stacking import STACKED
from tests.models.gguf.block_files import write_block_gguf

FOUR_BIT_LAYERS = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
                   "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}


def test_int4_layers_hold_the_files_blocks_exactly(tmp_path: Path) -> None:
    path = write_block_gguf(tmp_path / "q4.gguf", embedding=Q.Q8_0, layer_types=FOUR_BIT_LAYERS)
    stored = open_gguf_file(path).read_stored()
    prepared = prepare(path, compile=False)
    loaded, setup = prepared.loaded, prepared.setup
    assert setup.precision == "int4" and not setup.from_cache
    model = loaded.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert layers and all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
    head = layers.pop("lm_head", None)  # the tied Q8_0 embedding: fitted to 4 bits as before, not stored as such
    for name, layer in layers.items():
        prefix, _, last = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in STACKED[last]] if last in STACKED else [name]
        expected = torch.cat([stored.blocks[f"{p}.weight"].dequantize() for p in parts])  # the gguf library's values
        assert torch.equal(layer.dequantized(), expected), name
    embedding = stored.state["model.embed_tokens.weight"]
    if head is not None:
        assert (head.dequantized() - embedding).abs().max() < embedding.abs().max() / 7  # within a 4-bit step
    elif native_reason() is None:  # the tied head is the table's own Q8_0 blocks, the same bytes: nothing converted
        assert isinstance(model.lm_head, BlockLinear) and model.lm_head.block_type == Q.Q8_0
        assert model.lm_head.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()
        assert torch.equal(model.lm_head.dequantized_weight(), embedding)
    else:
        assert isinstance(model.lm_head, Int8Linear)
    ids = torch.tensor([[0, 1, 2, 1]])
    # the table stays in the file's blocks; a lookup gives the gguf library's values of its rows
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in model.parameters())
    assert torch.equal(model.model.embed_tokens(ids), embedding[ids])
    with torch.inference_mode():
        assert torch.isfinite(model(ids)).all()
