"""The "blocks" precision: a GGUF file's layers kept in the block types it stores.

The reference is the same file dequantized (the float32 path, bit-identical to the gguf
library's dequantizer: tests/models/gguf/test_dequantize.py), with each linear layer's input
rounded as the block layers round it where they do (AVX-512 VNNI); qkv's whole-layer kernel
multiplies the same blocks with the same products as the block layers it stands in for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.errors import QkvError
from qkv.runtime.native.block_ops import rounded_activations
from qkv.runtime.linear.block import BlockEmbedding, BlockLinear, StackedBlockLinear, native_reason
from qkv.runtime.native.repacked import repack_status
from qkv.runtime import DecodeSession, prepare_for_decoding
from qkv.runtime.prepare import prepare
from tests.models.gguf.block_files import write_block_gguf

needs_block_products = pytest.mark.skipif(native_reason() is not None, reason="qkv's block products do not build here")
PROMPT = torch.tensor([[0, 1, 2, 2, 1, 0, 1]])


def _as_block_layers_compute(reference: torch.nn.Module, blocks: torch.nn.Module) -> torch.nn.Module:
    """The float32 reading with every linear layer computing the blocks' math: its input rounded
    as the block layer of the same name rounds it for each of its parts' weight types
    (qkv.runtime.native.block_ops.rounded_activations: per 32 inputs, per 256 for K-quants), times
    the dequantized weights of those rows."""
    kept = dict(blocks.named_modules())

    def parts_of(name: str) -> list[tuple[int, Q]]:  # (rows, block type) of each stacked part
        layer = kept[name]
        members = layer.parts if isinstance(layer, StackedBlockLinear) else [layer]
        return [(part.out_features, part.block_type) for part in members]

    def as_blocks(parts: list[tuple[int, Q]]):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], _output: torch.Tensor) -> torch.Tensor:
            weights = module.weight.split([rows for rows, _ in parts])  # (N_i, K) each
            y = torch.cat([F.linear(rounded_activations(args[0], t), w) for w, (_, t) in zip(weights, parts)], dim=-1)
            return y if getattr(module, "bias", None) is None else y + module.bias
        return hook

    hooked = [module.register_forward_hook(as_blocks(parts_of(name))) for name, module in reference.named_modules()
              if isinstance(kept.get(name), (BlockLinear, StackedBlockLinear))]
    assert hooked, "no layer of the reference has a block layer of its name"
    return reference


def _close(have: torch.Tensor, want: torch.Tensor) -> bool:
    # activations are rounded: a float-rounding difference upstream (another summation order, a
    # compiled norm) can move one activation by a step, 1/127 of its group's largest: the int4
    # tests' bound (tests/runtime/test_layer_step.py)
    return torch.allclose(have, want, rtol=0, atol=2e-2 * (1 + float(want.abs().max())))


def _steps(model, steps: int = 5, **session) -> list[torch.Tensor]:
    """Logits of a prefill of PROMPT then `steps` greedy decode steps."""
    out = []
    with torch.inference_mode(), DecodeSession(model, batch_size=1, capacity=32, **session) as s:
        logits = s.prefill(PROMPT)
        for _ in range(steps):
            out.append(logits)
            logits = s.decode(logits.argmax(-1))
    return out


@needs_block_products
@pytest.mark.parametrize("tied", [True, False])
def test_auto_keeps_the_files_blocks_and_gives_the_dequantized_logits(tmp_path: Path, tied: bool) -> None:
    path = write_block_gguf(tmp_path / "mix.gguf", tied=tied, embedding=Q.Q8_0)
    prepared = prepare(path, precision="auto", compile=False)
    loaded, setup = prepared.loaded, prepared.setup
    model = loaded.model
    reference = _as_block_layers_compute(prepare(path, precision="float32", compile=False).model, model)
    assert setup.precision == "blocks"
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    # q, k and v are Q4_K, Q6_K and Q5_0 in this file: one stacked layer of three block types
    assert isinstance(attention.qkv_proj, StackedBlockLinear)
    assert [p.block_type for p in attention.qkv_proj.parts] == [Q.Q4_K, Q.Q6_K, Q.Q5_0]
    # its Q4_K rows (256: whole groups of 16) run repacked (qkv.runtime.native.repacked), in this test and the native layer's
    assert attention.qkv_proj.parts[0].repacked == (repack_status() is None)
    assert isinstance(attention.o_proj, BlockLinear) and attention.o_proj.block_type == Q.Q8_0
    assert isinstance(mlp.down_proj, BlockLinear) and mlp.down_proj.block_type == Q.Q4_1
    assert isinstance(model.model.embed_tokens, BlockEmbedding) and isinstance(model.lm_head, BlockLinear)
    if tied:  # the head multiplies the table's own bytes: one copy of them in memory
        assert model.lm_head.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no float32 matrix kept
    with torch.inference_mode():
        got, want = model(PROMPT), reference(PROMPT)
    assert _close(got, want)


@needs_block_products
@pytest.mark.parametrize("block_type", [Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M],
                         ids=lambda t: t.name)
def test_an_iq_file_is_kept_in_its_blocks_and_gives_the_dequantized_logits(tmp_path: Path, block_type: Q) -> None:
    """IQ4_XS and the grid types (common llama.cpp downloads of large models) are types "auto"
    keeps as stored, the embedding too, on the native layer step as on the block layers."""
    types = {name: block_type for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path = write_block_gguf(tmp_path / "iq.gguf", embedding=block_type, layer_types=types)
    prepared = prepare(path, precision="auto", compile=False)
    model = prepared.model
    assert prepared.setup.precision == "blocks"
    assert isinstance(model.model.embed_tokens, BlockEmbedding) and model.model.embed_tokens.block_type == block_type
    assert isinstance(model.model.layers[0].mlp.down_proj, BlockLinear)
    assert model.model.layers[0].mlp.down_proj.block_type == block_type
    reference = _as_block_layers_compute(prepare(path, precision="float32", compile=False).model, model)
    with torch.inference_mode():
        assert _close(model(PROMPT), reference(PROMPT))
    native = prepare(path, precision="auto", compile=True).model  # the whole-stack native step where it runs
    assert all(_close(a, b) for a, b in zip(_steps(native), _steps(model)))


@needs_block_products
def test_the_native_layer_multiplies_the_blocks_as_the_block_layers_do(tmp_path: Path) -> None:
    path = write_block_gguf(tmp_path / "mix.gguf", embedding=Q.Q8_0)
    prepared = prepare(path, precision="blocks", compile=True)
    loaded, setup = prepared.loaded, prepared.setup
    assert setup.layer_step is not None  # every layer (three block types stacked in q/k/v) runs as one native call
    with DecodeSession(loaded.model, batch_size=1, capacity=32, step="native", setup=setup) as session:
        assert session.runs_native
    native = _steps(loaded.model, step="native", setup=setup)
    modules = _steps(loaded.model, step="modules")
    for have, want in zip(native, modules):
        assert _close(have, want)
    assert [int(x.argmax()) for x in native] == [int(x.argmax()) for x in modules]


@needs_block_products
def test_rows_decoded_together_through_blocks_equal_each_row_alone_bit_for_bit(tmp_path: Path) -> None:
    path = write_block_gguf(tmp_path / "mix.gguf", embedding=Q.Q8_0)
    prepared = prepare(path, precision="blocks", compile=True)
    model, setup = prepared.model, prepared.setup
    prompts = {0: torch.tensor([0, 1, 2, 2]), 1: torch.tensor([2, 1]), 2: torch.tensor([1, 1, 0, 2, 0])}
    with torch.inference_mode():
        with DecodeSession(model, batch_size=3, capacity=32, kind=SlotKVCache, setup=setup) as session:
            assert session.runs_native
            last = {row: session.prefill_row(row, ids).argmax(-1) for row, ids in prompts.items()}
            together = session.decode(torch.stack([last[r] for r in (0, 1, 2)]), rows=[0, 1, 2])  # (3, V)
        alone = []
        for row in (0, 1, 2):
            with DecodeSession(model, batch_size=3, capacity=32, kind=SlotKVCache, setup=setup) as session:
                token = session.prefill_row(row, prompts[row]).argmax(-1)
                alone.append(session.decode(token[None], rows=[row])[0])
    assert torch.equal(together, torch.stack(alone))


@needs_block_products
@pytest.mark.parametrize("block_type", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_a_16_bit_file_is_kept_in_its_16_bits_and_gives_the_float32_logits(tmp_path: Path, block_type: Q) -> None:
    """A file of F16 (or BF16) matrices, as llama.cpp's convert_hf_to_gguf.py --outtype f16 writes
    it: "auto" keeps every layer matrix, the head and the embedding table in their 16 bits (no
    float32 matrix), multiplied against float32 activations as they are, so the logits are the
    float32 reading's up to summation order, in the modules and in the one native call a step."""
    layers = {name: block_type for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path = write_block_gguf(tmp_path / "sixteen.gguf", embedding=block_type, layer_types=layers)
    prepared = prepare(path, precision="auto", compile=True)
    model, setup = prepared.model, prepared.setup
    assert setup.precision == "blocks" and setup.layer_step is not None
    kept = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(kept) >= 4 and {m.block_type for m in kept} == {block_type}
    assert isinstance(model.model.embed_tokens, BlockEmbedding) and model.model.embed_tokens.block_type == block_type
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no float32 matrix kept
    assert not any(b.dtype == torch.float32 and b.dim() == 2 for b in model.buffers())
    reference = prepare(path, precision="float32", compile=False).model
    with torch.inference_mode():
        got, want = model(PROMPT), reference(PROMPT)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * (1 + float(want.abs().max())))
    with DecodeSession(model, batch_size=1, capacity=32, step="native", setup=setup) as session:
        assert session.runs_native  # a decode step is one native call
    native, floats = _steps(model, step="native", setup=setup), _steps(reference)
    for have, expected in zip(native, floats):
        assert torch.allclose(have, expected, rtol=1e-4, atol=1e-5 * (1 + float(expected.abs().max())))


def test_blocks_is_refused_by_name_where_there_are_no_blocks(tmp_path: Path) -> None:
    from qkv.models.llama import LlamaForCausalLM
    from qkv.models.configs.llama import LlamaConfig

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    with pytest.raises(QkvError, match="blocks precision keeps a GGUF file's own blocks"):
        prepare_for_decoding(model, precision="blocks")
    path = write_block_gguf(tmp_path / "f32.gguf", embedding=Q.F32,
                            layer_types={"attn_q": Q.F32, "attn_k": Q.F32, "attn_v": Q.F32, "attn_output": Q.F32,
                                         "ffn_gate": Q.F32, "ffn_up": Q.F32, "ffn_down": Q.F32})
    with pytest.raises(QkvError, match="--dtype blocks needs a GGUF file whose layer matrices"):
        prepare(path, precision="blocks")
    assert prepare(path, precision="auto", compile=False).setup.precision == "int8"


GGUF_KINDS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "smollm3"]


@needs_block_products
@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_every_architecture_in_q8_0_decodes_from_its_blocks_as_dequantized(kind: str, tmp_path: Path) -> None:
    """Each GGUF architecture qkv reads, its matrices quantized to Q8_0 as llama-quantize would:
    "auto" keeps the blocks, and a prefill plus decode steps give the float32 reading's logits."""
    from tests.models.gguf.gguf_convert import write_gguf
    from tests.models.gguf.test_arch import _source
    from tests.models.conftest import make_tokenizer

    path = write_gguf(tmp_path / f"{kind}.gguf", _source(kind), make_tokenizer(), block_type=Q.Q8_0)
    prepared = prepare(path, precision="auto", compile=True)
    loaded, setup = prepared.loaded, prepared.setup
    reference = _as_block_layers_compute(prepare(path, precision="float32", compile=False).model, loaded.model)
    assert setup.precision == "blocks"
    assert any(isinstance(m, (BlockLinear, StackedBlockLinear)) for m in loaded.model.modules())
    got, want = _steps(loaded.model, 4, setup=setup), _steps(reference, 4)
    for have, expected in zip(got, want):
        assert _close(have, expected)


@needs_block_products
def test_a_gpt2_file_in_blocks_runs_at_int8_by_default_and_refuses_blocks_by_name(tmp_path: Path) -> None:
    """qkv's GPT-2 holds the book's split W_query/W_key/W_value, not the file's stacked Conv1D
    matrices one for one: "auto" prepares it at int8, and "blocks" says why it cannot."""
    from tests.models.conftest import make_tokenizer
    from tests.models.gguf.gguf_convert import write_gguf
    from tests.models.gguf.test_arch import _source

    path = write_gguf(tmp_path / "gpt2.gguf", _source("gpt2"), make_tokenizer(), block_type=Q.Q8_0)
    assert prepare(path, precision="auto", compile=False).setup.precision == "int8"
    with pytest.raises(QkvError, match="gpt2.gguf is not one: choose auto, int8 or int4"):
        prepare(path, precision="blocks", compile=False)


@needs_block_products
def test_the_memory_check_counts_the_blocks_as_stored(tmp_path: Path) -> None:
    """A file kept in its blocks needs about its own size, not its float32 values: a limit
    between the two lets "auto" (blocks) load it and refuses int8, which reads float32 first."""
    from qkv.models.gguf.checkpoint import open_gguf_file

    path = write_block_gguf(tmp_path / "mix.gguf", embedding=Q.Q8_0)
    file = open_gguf_file(path)
    assert file.stored_bytes < file.read_bytes / 2
    limit = 2 * file.stored_bytes + (1 << 20)  # the blocks and the modules' overhead fit; float32 does not
    assert prepare(path, precision="auto", compile=False, max_memory=limit).setup.precision == "blocks"
    with pytest.raises(QkvError, match="memory"):
        prepare(path, precision="int8", compile=False, max_memory=limit)


def test_blocks_are_views_of_the_file_and_writes_stay_private(tmp_path: Path) -> None:
    """The file's blocks are read from its copy-on-write mapping, not copied into memory of
    their own (q and k, whose rows are put back in Hugging Face order, are copies by nature),
    and a write into a view never reaches the file."""
    from qkv.models.loader import open_model
    from qkv.runtime.huge_pages import file_mapped_ranges

    types = {name: Q.Q4_K for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
    path = write_block_gguf(tmp_path / "mapped.gguf", layer_types={**types, "attn_v": Q.Q8_0, "ffn_down": Q.Q6_K})
    before = path.read_bytes()
    stored = open_model(str(path)).source.read_stored(torch.float32, embedding=True)
    ranges = file_mapped_ranges()
    mapped = {name for name, b in stored.blocks.items() if any(s <= b.blocks.data_ptr() < e for s, e in ranges)}
    assert "model.layers.0.self_attn.v_proj.weight" in mapped and "model.layers.0.mlp.down_proj.weight" in mapped
    assert "model.layers.0.self_attn.q_proj.weight" not in mapped  # rows permuted back: a copy
    down = stored.blocks["model.layers.0.mlp.down_proj.weight"]
    want = down.dequantize()
    down.blocks.zero_()  # a private page now: the file is unchanged
    assert path.read_bytes() == before
    again = open_model(str(path)).source.read_stored(torch.float32, embedding=True)
    assert torch.equal(again.blocks["model.layers.0.mlp.down_proj.weight"].dequantize(), want)
