"""A rank's slices, read from the file alone, are the slices of the whole tensors: a GGUF slice
decodes to the `gguf` package's dequantized tensor cut the same way (rows, whole-block columns
kept in blocks, columns inside blocks decoded); the ranks' slices of every checkpoint tensor
tile the tensor the one-process loader reads; models that cannot be split are refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from qkv.errors import QkvError
from qkv.models.gguf.header import read_header
from qkv.models.gguf.layout import gguf_shape
from qkv.models.gguf.stored import StoredBlocks
from qkv.models.loader import open_model
from qkv.models.tensor_parallel.group import TensorParallel
from qkv.models.tensor_parallel.opened import open_rank
from qkv.models.tensor_parallel.slices import GGUFSlices, TensorSlice
from tests.models.conftest import make_tokenizer, save_tiny
from tests.models.gguf.block_files import write_block_gguf


def test_gguf_slices_are_the_dequantized_tensors_cut(tmp_path: Path) -> None:
    path = write_block_gguf(tmp_path / "mix.gguf", tied=False)
    reader = GGUFSlices(path)
    try:
        for tensor in read_header(path).tensors:
            whole = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                              dtype=np.float32)).reshape(gguf_shape(tensor))
            if whole.dim() == 1:
                got = reader.read(tensor, TensorSlice(rows=range(3, 17)), keep_blocks=True, rope_heads=None)
                assert torch.equal(got, whole[3:17])
                continue
            rows, cols = whole.shape
            weights = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
            parts = {"rows": TensorSlice(rows=range(1, rows - 1)),
                     "whole blocks": TensorSlice(cols=range(weights, cols)) if cols > weights else TensorSlice(),
                     "inside blocks": TensorSlice(rows=range(1, min(4, rows)), cols=range(5, cols - 7))}
            for what, part in parts.items():
                got = reader.read(tensor, part, keep_blocks=True, rope_heads=None)
                r = part.rows or range(rows)
                c = part.cols or range(cols)
                want = whole[r.start:r.stop, c.start:c.stop]
                blocks = what != "inside blocks" and weights > 1
                assert isinstance(got, StoredBlocks) == blocks, (tensor.name, what)
                assert torch.equal(got.dequantize() if blocks else got, want), (tensor.name, what)
    finally:
        reader.close()


def _tiles(whole: torch.Tensor, parts: list[torch.Tensor], name: str) -> None:
    if torch.equal(parts[0], whole):  # held whole by every rank (norms)
        assert all(torch.equal(p, whole) for p in parts), name
        return
    for dim in (0, 1):
        if whole.dim() > dim and sum(p.shape[dim] for p in parts) == whole.shape[dim]:
            assert torch.equal(torch.cat(parts, dim=dim), whole), name
            return
    raise AssertionError(f"{name}: {[tuple(p.shape) for p in parts]} do not tile {tuple(whole.shape)}")


@pytest.mark.parametrize("kind", ["llama-gguf", "qwen2", "llama"])
def test_the_ranks_slices_tile_what_one_process_reads(kind: str, tmp_path: Path) -> None:
    """The GGUF llama's q/k rows are stored permuted per head: each rank's heads come back in
    rotate-half order. Qwen2's biases split with their rows; o_proj's bias is rank 0's alone."""
    if kind == "llama-gguf":
        from tests.models.gguf.gguf_convert import write_gguf
        from tests.models.gguf.test_arch import _source

        source = write_gguf(tmp_path / "llama.gguf", _source("llama"), make_tokenizer())
        world = 2
    else:
        source = tmp_path / kind
        save_tiny(kind, source, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
        world = 3
    opened = open_model(source)
    whole = opened.source.read_tensors(torch.float32)
    ranks = [open_rank(opened, TensorParallel(rank, world)).source.read_tensors(torch.float32) for rank in range(world)]
    assert set(ranks[0]) >= set(whole) - {"lm_head.weight"}
    for name, tensor in whole.items():
        _tiles(tensor, [r[name] for r in ranks], name)


def test_a_model_with_one_kv_head_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    from tests.models.gguf.gguf_convert import write_gguf
    from tests.models.gguf.test_reference import _source

    path = write_gguf(tmp_path / "gemma3.gguf", _source("gemma3"), make_tokenizer())  # 1 KV head, as Gemma 3 270M
    with pytest.raises(QkvError, match="1 key/value head .* it cannot be split: run it on one process"):
        open_rank(open_model(path), TensorParallel(0, 2))
