"""2 and 3 ranks on loopback give what one process gives: float32 logits within 1e-5, and the
same greedy and seeded-sampled tokens at float32, int8, int4 and blocks (greedy also through
each rank's native layer step, split at the all-reduces, against one process's layer step), on checkpoints built
here (transformers' save_pretrained; GGUF files written with the gguf package); a rank that
dies stops the others with one line; ranks on different files are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qkv.generation.loop import generate
from qkv.models.loader import load_pretrained
from qkv.runtime.prepare import load_for_generation
from tests.models.conftest import make_tokenizer, save_tiny
from tests.models.tensor_parallel.rank_worker import IDS
from tests.models.tensor_parallel.ranks import start_ranks


def _gguf(kind: str, folder: Path, *, kquants: bool = False) -> Path:
    from tests.models.gguf.gguf_convert import write_gguf

    if kquants:  # hidden 256: whole K-quant super-blocks; o_proj's 128-column slices are not
        from tests.models.gguf.kquant_files import requantize
        from tests.models.gguf.test_reference import _source
    else:
        from tests.models.gguf.test_arch import _source
    path = write_gguf(folder / f"{kind}.gguf", _source(kind), make_tokenizer())
    if kquants:
        requantize(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name == "llama":  # 4 query heads on 2 KV heads, untied head
                save_tiny("llama", folder)
                made[name] = folder
            elif name == "qwen2":  # 6 query heads on 3 KV heads, q/k/v biases, tied head
                save_tiny("qwen2", folder, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
                made[name] = folder
            elif name == "gemma2":  # soft-caps, post-norms, norm weights + 1 in the file, tied head
                made[name] = _gguf("gemma2", folder)
            elif name.startswith("gguf:"):  # every family as tests/models/gguf/test_arch.py builds it
                made[name] = _gguf(name.partition(":")[2], folder)
            elif name.startswith("folder:"):  # the same model saved by transformers
                from tests.models.gguf.test_arch import _source

                _source(name.partition(":")[2]).save_pretrained(folder)
                make_tokenizer().save(str(folder / "tokenizer.json"))
                made[name] = folder
            else:  # a Q4_K_M-like mix of block types
                made[name] = _gguf("llama", folder, kquants=True)
        return made[name]

    return make


def _one_process(model: Path, precisions: list[str]) -> dict[str, torch.Tensor]:
    reference, _ = load_pretrained(model)
    with torch.no_grad():
        want = {"logits": reference(IDS)}
    for precision in precisions:
        prepared, _, setup = load_for_generation(model, precision=precision, compile=False)
        with torch.no_grad():
            want[f"logits/{precision}"] = prepared(IDS)
        want[f"greedy/{precision}"] = generate(prepared, IDS, 8)
        want[f"native/{precision}"] = generate(prepared, IDS, 8, setup=setup)  # one process's layer step
        want[f"sampled/{precision}"] = generate(prepared, IDS, 8, temperature=1.0, seed=7)
    return want


@pytest.mark.parametrize(("name", "ranks", "precisions"), [
    ("llama", 2, "float32,int8,int4"), ("qwen2", 3, "float32"), ("gemma2", 2, "float32"), ("kquants", 2, "blocks"),
    # Phi-3 stores q/k/v and gate/up stacked (a rank reads its stretches of the stacked rows); OLMo 2's
    # q/k norm spans every head (its statistic all-reduced); Qwen3's is per head; Gemma 3 mixes
    # sliding and global layers; SmolLM3 leaves RoPE out of some layers
    ("folder:phi3", 2, "float32"), ("gguf:phi3", 2, "float32"), ("folder:olmo2", 2, "float32"),
    ("gguf:olmo2", 2, "float32"), ("gguf:qwen3", 2, "float32"), ("gguf:gemma3", 2, "float32"),
    ("gguf:mistral", 2, "float32"), ("gguf:smollm3", 2, "float32"),
])
def test_ranks_give_one_process_logits_and_tokens(models: Any, tmp_path: Path, name: str, ranks: int,
                                                  precisions: str) -> None:
    model = models(name)
    done = start_ranks(ranks, str(model), precisions, str(tmp_path))
    assert done.codes == [0] * ranks, done.stderr
    want = _one_process(model, precisions.split(","))
    for rank in range(ranks):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # the same sums in another order: 1e-5, or 32 float32 steps of the largest logit where that is more
        exact = max(1e-5, 32 * torch.finfo(torch.float32).eps * float(want["logits"].abs().max()))
        torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=exact)
        for key in want:
            precision = key.partition("/")[2]
            if key.startswith("logits/") and got[f"decoded/{precision}"]:
                # a decoded slice multiplies float activations where one process rounds them per block
                # of the whole row: another rounding of the same model, no further from the exact one
                rank_error = float((got[key] - want["logits"]).abs().max())
                one_error = float((want[key] - want["logits"]).abs().max())
                assert rank_error <= 1.5 * one_error + 1e-5, (rank, key, rank_error, one_error)
            elif key.startswith("logits/"):  # the same math; a rounded precision to its rounding step
                bound = exact if precision == "float32" else 2e-2 * (1 + float(want[key].abs().max()))
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=bound)
            elif key != "logits" and not got[f"decoded/{precision}"]:
                assert torch.equal(got[key], want[key]), (rank, key, got[key], want[key])
            elif key != "logits":
                # a matrix whose slice cuts its blocks runs decoded on the rank with float activations,
                # where one process rounds them per block of the whole row: the same model to the
                # rounding step (the logits above), not token for token through a near-tie
                assert got[key].shape == want[key].shape and torch.equal(got[key][:, :IDS.shape[1]], IDS)
        for precision in precisions.split(","):  # the ranks stepped on qkv's native layers (OLMo 2: the modules)
            assert got[f"layer_step/{precision}"] == ("olmo2" not in name), (rank, precision)
        first = torch.load(tmp_path / "rank0.pt")
        for precision in precisions.split(","):  # a seed drawn by rank 0 samples the same tokens everywhere
            assert torch.equal(got[f"unseeded/{precision}"], first[f"unseeded/{precision}"]), (rank, precision)
        if "blocks" in precisions:
            # layer 0's o_proj is Q4_K (256 weights a block): its 128-column slices are decoded; layer 1's
            # (Q5_0, 32 a block) and every other matrix stay in blocks
            assert got["decoded/blocks"] == ["model.layers.0.self_attn.o_proj.weight"], got["decoded/blocks"]
            assert got["block_layers/blocks"] >= 2 * 2, got["block_layers/blocks"]


def test_a_rank_that_dies_stops_the_others_with_one_line(models: Any, tmp_path: Path) -> None:
    done = start_ranks(3, str(models("qwen2")), "float32", str(tmp_path), "die", timeout=60)
    assert done.codes[1] == 3
    for rank in (0, 2):
        assert done.codes[rank] == 2, done.stderr[rank][-2000:]
        lines = [line for line in done.stderr[rank].splitlines() if line.strip()]
        assert len(lines) == 1 and "another rank stopped or did not answer" in lines[0], done.stderr[rank][-2000:]


def test_ranks_on_different_files_are_refused(tmp_path: Path) -> None:
    for rank, text in enumerate(["same", "same", "other"]):
        (tmp_path / f"file{rank}").write_text(text)
    done = start_ranks(3, str(tmp_path), "mismatch", str(tmp_path), timeout=60)
    assert done.codes == [2, 2, 2], done.stderr
    assert "rank 2 opened a model file whose bytes differ from rank 0's" in done.stderr[0], done.stderr[0]
