"""qkv.runtime.linear.block: a linear layer on GGUF blocks as stored, native and torch reference,
against F.linear of the activations rounded as the weight type multiplies them (per 32, per 256
for K-quants) and the gguf library's dequantized weights; a whole model on such
layers (tests/runtime/test_stored_blocks.py: the runtime's mapping of a whole file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

from qkv.models.gguf.stored import StoredBlocks
from qkv.runtime.native import native_kernels
from qkv.runtime.native.block_ops import product_bound, rounded_activations
from qkv.runtime.linear.block import BlockEmbedding, BlockLinear, block_embedding, stacked_block_linear
from tests.models.gguf.block_files import random_blocks

native = pytest.mark.skipif(not native_kernels().available, reason=f"qkv's kernels are not available: {native_kernels().reason}")
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16]


def stored(block_type: Q, rows: int = 40, cols: int = 512, seed: int = 0) -> StoredBlocks:
    raw = random_blocks(block_type, (rows, cols), np.random.default_rng(seed))
    return StoredBlocks(torch.from_numpy(raw.copy()), block_type, (rows, cols))


def within_rounding(y: torch.Tensor, rounded: torch.Tensor, w: torch.Tensor, block_type: Q) -> bool:
    """y is the product of the rounded activations and w up to float32 rounding of the block sums."""
    rows = rounded.double().reshape(-1, w.shape[1])
    exact = rows @ w.double().t()
    bound = product_bound(rows, w.double(), w.shape[1], block_type)
    return bool(((y.double().reshape(exact.shape) - exact).abs() <= bound).all())


@native
@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_native_layer_is_the_dequantized_product_within_rounding(block_type: Q) -> None:
    blocks = stored(block_type)
    layer = BlockLinear(blocks, native=True)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(1))  # (B, T, K)
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32
    # on every CPU the product is of the activations rounded as the weight type multiplies them
    assert within_rounding(y, rounded_activations(x, block_type), blocks.dequantize(), block_type)
    # and the torch reference (machines without the native kernels) is the same math
    assert within_rounding(BlockLinear(blocks, native=False)(x), rounded_activations(x, block_type), blocks.dequantize(), block_type)
    # a row's numbers do not depend on the other rows of the batch
    assert torch.equal(layer(x[1:, 2:]), y[1:, 2:])


@pytest.mark.parametrize("block_type", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_reference_layer_is_f_linear_on_the_gguf_weights(block_type: Q) -> None:
    """The path of machines without the native kernels: the same weights and rounded
    activations, F.linear's product."""
    blocks = stored(block_type)
    bias = torch.randn(40)
    layer = BlockLinear(blocks, bias, native=False)
    x = torch.randn(5, 512)
    assert not layer.native and torch.equal(layer(x), F.linear(rounded_activations(x, block_type), blocks.dequantize(), bias))
    assert torch.equal(layer.dequantized_weight(), blocks.dequantize())


def test_q4_0_is_multiplied_as_stored_not_refit() -> None:
    """Q4_0's weights are d * (q - 8) exactly as the file has them (qkv.runtime.linear.quantized would re-fit a
    Q4_1 min/max to them): the layer holds the file's bytes and decodes those."""
    blocks = stored(Q.Q4_0)
    layer = BlockLinear(blocks)
    assert torch.equal(layer.blocks, blocks.blocks) and layer.blocks.dtype == torch.uint8
    assert layer.blocks.numel() == 40 * 512 // 32 * 18  # 4.5 bits a weight, as in the file


def test_wrong_sizes_are_refused() -> None:
    layer = BlockLinear(stored(Q.Q8_0), native=False)
    with pytest.raises(ValueError, match="input of 100 features for a layer of 512"):
        layer(torch.randn(1, 100))
    with pytest.raises(ValueError, match="bias of shape"):
        BlockLinear(stored(Q.Q8_0), torch.zeros(3))


def test_stacked_matrices_give_the_stacked_outputs() -> None:
    """q, k and v of one type stack into one BlockLinear (rows of blocks concatenated), of
    different types into parts; either way the outputs are the parts' outputs side by side."""
    q, k, v = stored(Q.Q5_0, 24, 256, seed=1), stored(Q.Q5_0, 8, 256, seed=2), stored(Q.Q8_0, 8, 256, seed=3)
    x = torch.randn(3, 256)
    same = stacked_block_linear([q, k])
    assert isinstance(same, BlockLinear) and same.out_features == 32
    assert torch.equal(same(x), torch.cat([BlockLinear(q)(x), BlockLinear(k)(x)], dim=-1))
    mixed = stacked_block_linear([q, k, v], bias=torch.arange(40.0))
    expected = torch.cat([BlockLinear(p)(x) for p in (q, k, v)], dim=-1) + torch.arange(40.0)
    assert mixed.out_features == 40 and torch.equal(mixed(x), expected)
    with pytest.raises(ValueError, match="one column count"):
        stacked_block_linear([q, stored(Q.Q8_0, 8, 512)])


@pytest.mark.parametrize("block_type", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_stacked_parts_of_one_type_are_written_once_and_stored_gives_their_bytes(block_type: Q) -> None:
    """Parts of one type become one layer whose rows are written once (repacked in place where
    the type is repacked), the parts untouched; its stored blocks are the parts' bytes one after
    the other, and parts of two types are refused by name."""
    q, k, v = stored(block_type, 32, 512, seed=4), stored(block_type, 16, 512, seed=5), stored(block_type, 16, 512, seed=6)
    before = [p.blocks.clone() for p in (q, k, v)]
    layer = BlockLinear([q, k, v])
    assert layer.out_features == 64 and all(layer.blocks.data_ptr() != p.blocks.data_ptr() for p in (q, k, v))
    assert all(torch.equal(p.blocks, b) for p, b in zip((q, k, v), before))
    assert torch.equal(layer.stored.blocks, torch.cat(before))
    x = torch.randn(2, 512)
    assert torch.equal(layer(x), BlockLinear(StoredBlocks(torch.cat(before), block_type, (64, 512)))(x))
    with pytest.raises(ValueError, match="one block type and one column count"):
        BlockLinear([q, stored(Q.Q5_0, 16, 512)])


def test_without_the_native_kernels_the_reference_runs_and_says_so_once(tmp_path: Path) -> None:
    """QKV_NATIVE=0 stands for a machine without a compiler: the layers run F.linear on the
    dequantized weights and the rounded activations (the same numbers within rounding) and one
    line on stderr says why."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, numpy as np\n"
        "from gguf.constants import GGMLQuantizationType as Q\n"
        "from qkv.models.gguf.stored import StoredBlocks\n"
        "from qkv.runtime.linear.block import BlockLinear\n"
        "from tests.models.gguf.block_files import random_blocks\n"
        "s = StoredBlocks(torch.from_numpy(random_blocks(Q.Q4_K, (8, 256), np.random.default_rng(0)).copy()), Q.Q4_K, (8, 256))\n"
        "layers = [BlockLinear(s), BlockLinear(s)]\n"
        "x = torch.randn(2, 256)\n"
        "assert not any(l.native for l in layers)\n"
        "from qkv.runtime.native.block_ops import rounded_activations\n"
        "assert torch.equal(layers[0](x), torch.nn.functional.linear(rounded_activations(x, Q.Q4_K), s.dequantize()))\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "QKV_NATIVE": "0", "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    lines = [line for line in done.stderr.splitlines() if "reference product" in line]
    assert lines == ["qkv: GGUF block layers run PyTorch's reference product (turned off with QKV_NATIVE=0)"]


@native
@pytest.mark.parametrize("block_type", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_tied_tables_lookup_reads_the_heads_blocks_and_gives_the_files_rows(block_type: Q) -> None:
    """A tied output head repacked at load (Q8_0, Q4_K) holds the only copy of the table: the
    lookup reads the head's blocks and gives the rows the file's blocks decode to, bit for bit;
    a head kept as stored (Q6_K) shares the file's blocks as before."""
    table = stored(block_type, rows=48, cols=512, seed=3)
    head = BlockLinear(table)
    lookup = block_embedding(table, head, tied=True)
    assert lookup.blocks.data_ptr() == head.blocks.data_ptr() and lookup.repacked == head.repacked
    ids = torch.tensor([[0, 47, 16, 16], [31, 5, 32, 1]])  # (2, 4): rows of every group, one twice
    assert torch.equal(lookup(ids), BlockEmbedding(table)(ids))
    assert torch.equal(lookup(ids), table.dequantize()[ids])
    assert block_embedding(table, head, tied=False).blocks.data_ptr() == table.blocks.data_ptr()  # an untied table: the file's
