"""qkv.models.gguf.stored: a GGUF file's matrices handed over as stored blocks, on a file
written with the gguf package (random block bytes, a different block type per matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from qkv.errors import QkvError
from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf.checkpoint import open_gguf_file
from qkv.models.gguf.tensors import read_state_dict
from qkv.models.gguf.stored import StoredBlocks, is_projection, read_stored_state
from tests.models.gguf.block_files import write_block_gguf

def read_both(path: Path):
    file = open_gguf_file(path)
    stored = read_stored_state(file.reader, file.config, file.path, torch.float32)
    return file, stored, read_state_dict(file.reader, file.config, file.path, torch.float32)


def test_projections_come_as_blocks_that_decode_to_the_state_dicts_tensors(tmp_path: Path) -> None:
    """Rows in Hugging Face order (q/k unpermuted as bytes): dequantizing the stored blocks gives
    read_state_dict's tensor bit for bit, and the rest of the file is dequantized as before."""
    file, stored, state = read_both(write_block_gguf(tmp_path / "blocks.gguf"))
    projections = {name for name in state if is_projection(name)}
    assert set(stored.blocks) == projections | {"lm_head.weight"}  # tied: the embedding's blocks serve the head
    assert set(stored.state) == set(state) - projections
    for name, blocks in stored.blocks.items():
        reference = state["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert blocks.shape == tuple(reference.shape) and blocks.blocks.dtype == torch.uint8
        assert torch.equal(blocks.dequantize(), reference), name
    for name, tensor in stored.state.items():
        assert torch.equal(tensor, state[name]), name
    assert stored.blocks["model.layers.0.self_attn.q_proj.weight"].block_type == Q.Q4_K
    assert stored.blocks["lm_head.weight"].block_type == Q.Q6_K


def test_an_untied_head_is_the_files_output_matrix(tmp_path: Path) -> None:
    _, stored, state = read_both(write_block_gguf(tmp_path / "untied.gguf", tied=False))
    assert stored.blocks["lm_head.weight"].block_type == Q.Q8_0
    assert torch.equal(stored.blocks["lm_head.weight"].dequantize(), state["lm_head.weight"])
    assert "lm_head.weight" not in stored.state and "model.embed_tokens.weight" in stored.state


def test_float_matrices_stay_tensors_and_keep_chooses_the_blocks(tmp_path: Path) -> None:
    _, stored, _ = read_both(write_block_gguf(tmp_path / "f32.gguf", embedding=Q.F32))
    assert "lm_head.weight" not in stored.blocks and "model.embed_tokens.weight" in stored.state
    file = open_gguf_file(write_block_gguf(tmp_path / "blocks.gguf"))
    kept = read_stored_state(file.reader, file.config, file.path, torch.float32, keep=lambda name: "mlp" in name)
    assert set(kept.blocks) == {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}


def test_inconsistent_blocks_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Q4_K blocks of a .* must be contiguous uint8"):
        StoredBlocks(torch.zeros(2, 100, dtype=torch.uint8), Q.Q4_K, (2, 256))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        StoredBlocks(torch.zeros(2, 144, dtype=torch.uint8), Q.Q4_K, (2, 200))
    with pytest.raises(ValueError, match="Q8_1 is not a block type qkv reads"):
        StoredBlocks(torch.zeros(2, 36, dtype=torch.uint8), Q.Q8_1, (2, 32))


def test_file_method_reads_the_same(tmp_path: Path) -> None:
    file = open_gguf_file(write_block_gguf(tmp_path / "blocks.gguf"))
    assert set(file.read_stored().blocks) == set(read_stored_state(file.reader, file.config, file.path, torch.float32).blocks)


def test_a_matrix_whose_bytes_disagree_with_its_type_is_named(tmp_path: Path, monkeypatch) -> None:
    """The header's sizes are checked on reading; were a matrix's bytes still off, the file
    and the tensor are named (QkvError), not a bare ValueError."""
    file = open_gguf_file(write_block_gguf(tmp_path / "blocks.gguf"))
    monkeypatch.setitem(gguf_blocks.BLOCK_FORMATS, Q.Q4_K, gguf_blocks.BLOCK_FORMATS[Q.Q4_K].__class__(
        256, 143, gguf_blocks.BLOCK_FORMATS[Q.Q4_K].decode, (0, 2)))
    with pytest.raises(QkvError, match="blocks.gguf: tensor blk.0.attn_q.weight: Q4_K blocks"):
        read_stored_state(file.reader, file.config, file.path, torch.float32)
