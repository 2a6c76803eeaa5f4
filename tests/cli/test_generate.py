"""`qkv generate`: streamed text equals the library's generation, valid UTF-8, bad input
gives one line and exit code 2."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import qkv
from qkv.cli.main import main
from qkv.models.gpt2 import GPTConfig, GPT2Decoder

VOCAB = 288
PROMPT = "naïve café"


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with few merges: accented characters span two tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["Your journey starts with one step. Every effort moves you."] * 4, trainer)
    assert tok.get_vocab_size() == VOCAB
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A book GPT with large random weights, saved the way training saves it."""
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=VOCAB, context_length=48, emb_dim=64, n_heads=4, n_layers=2))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    path = tmp_path_factory.mktemp("gpt")
    qkv.save_pretrained(model.eval(), byte_tokenizer(), path)
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_streams_what_generate_makes(folder: Path, capsys) -> None:
    code, out, err = run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "25")
    model, tokenizer = qkv.load_pretrained(folder)
    prompt_ids = tokenizer.encode(PROMPT).ids
    ids = qkv.generate(model, torch.tensor([prompt_ids]), 25)[0].tolist()
    assert code == 0
    assert out == tokenizer.decode(ids) + "\n"
    assert "25 tokens in" in err and "tokens/s" in err
    assert gc.isenabled()  # the collector held while loading (qkv.util.heap) is the caller's again


def test_no_cache_and_bfloat16_run(folder: Path, capsys) -> None:
    args = ["--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "10", "--no-compile"]
    _, cached, _ = run(capsys, *args)
    code, uncached, err = run(capsys, *args, "--no-cache")
    assert code == 0 and uncached == cached and "no cache" in err
    code, _, err = run(capsys, *args, "--dtype", "bfloat16")
    assert code == 0 and "bfloat16" in err


@pytest.mark.slow
def test_default_is_int8_compiled_and_float32_compiled_gives_the_eager_text(folder: Path, capsys) -> None:
    """No flags on a float checkpoint: int8 weights, the decode step compiled (qkv's fused
    layers), said on stderr apart from tokens/s. --dtype float32 compiled gives the exact
    eager text, fused and through Inductor (bfloat16 compiles with Inductor)."""
    args = ["--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "12"]
    code, default, err = run(capsys, *args)
    assert code == 0 and default.startswith(PROMPT)
    assert "one call of qkv's kernels per layer" in err and "(int8, layer step, " in err and "KV cache, " in err
    _, eager, err = run(capsys, *args, "--dtype", "float32", "--no-compile")
    assert "(float32, eager, " in err and "KV cache, " in err and "qkv's kernels per layer" not in err
    torch._dynamo.reset()
    code, compiled, err = run(capsys, *args, "--dtype", "float32")
    assert code == 0 and compiled == eager and "(float32, layer step, " in err
    code, _, err = run(capsys, *args, "--dtype", "bfloat16")
    assert code == 0 and "compiled the decode step in" in err and "(bfloat16, compiled, " in err
    code, four_bits, err = run(capsys, *args, "--dtype", "int4", "--no-compile")
    assert code == 0 and four_bits.startswith(PROMPT) and "(int4, eager, " in err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", *args, "--dtype", "int3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "int3" in err and len(err.strip().splitlines()) == 1


def test_sampling_repeats_with_a_seed(folder: Path, capsys) -> None:
    args = ["--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "20",
            "--temperature", "1.0", "--top-k", "40", "--top-p", "0.9"]
    first = run(capsys, *args, "--seed", "5")[1]
    again = run(capsys, *args, "--seed", "5")[1]
    other = run(capsys, *args, "--seed", "6")[1]
    assert first == again and first != other


# ---- bad input: one line on stderr, exit code 2 -------------------------------------------


def assert_one_line_error(code: int, err: str, message: str) -> None:
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert message in err


def test_missing_folder(tmp_path: Path, capsys) -> None:
    code, out, err = run(capsys, "--model", str(tmp_path / "none"), "--prompt", "x")
    assert_one_line_error(code, err, "does not exist")
    assert out == ""


def test_unknown_architecture(folder: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    config.update(model_type="rwkv", architectures=["RwkvForCausalLM"])
    (copy / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "--model", str(copy), "--prompt", "x")
    assert_one_line_error(code, err, "unknown architecture ['RwkvForCausalLM']")


def test_corrupt_weights(folder: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "model.safetensors").write_bytes(b"\x00" * 40)
    code, _, err = run(capsys, "--model", str(copy), "--prompt", "x")
    assert_one_line_error(code, err, "model.safetensors is truncated or corrupt")
    assert gc.isenabled()  # a load that failed leaves the collector on


def test_past_the_context_the_window_is_cropped_and_said(folder: Path, capsys) -> None:
    code, out, err = run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "60")
    model, tokenizer = qkv.load_pretrained(folder)
    prompt_ids = tokenizer.encode(PROMPT).ids
    with pytest.warns(UserWarning, match="pass the context length"):
        ids = qkv.generate(model, torch.tensor([prompt_ids]), 60)[0].tolist()
    assert code == 0
    assert out == tokenizer.decode(ids) + "\n"
    said = [line for line in err.splitlines() if "context length" in line]
    assert len(said) == 1 and "pass the context length (48)" in said[0] and "last 48 tokens" in said[0]


def test_negative_count(folder: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "-3")
    assert_one_line_error(exit_.value.code, capsys.readouterr().err, "argument --max-new-tokens: must be from 0")


def test_threads_are_set_and_reported(folder: Path, capsys) -> None:
    code, text, err = run(capsys, "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "3",
                          "--threads", "1")
    assert code == 0 and text.startswith(PROMPT)
    assert err.rstrip().endswith("KV cache, 1 thread)") and torch.get_num_threads() == 1


def test_each_wait_says_what_it_does_on_stderr_before_the_first_token(folder: Path) -> None:
    """In a real process with QKV_STATUS_AFTER_S=0 every step says itself (by default only a
    step still running after a second does): in order, all before the text."""
    env = {**os.environ, "QKV_STATUS_AFTER_S": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-m", "qkv", "generate", "--model", str(folder), "--prompt", PROMPT,
                           "--max-new-tokens", "3", "--dtype", "float32", "--threads", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout.decode(errors="replace")
    lines = done.stdout.decode("utf-8").splitlines()
    steps = [f"opening {folder}...", "loading the weights...", "preparing the float32 weights...",
             "getting the decode step ready..."]
    assert all(step in lines for step in steps), lines
    text = next(i for i, line in enumerate(lines) if line.startswith(PROMPT))
    assert [lines.index(step) for step in steps] == sorted(lines.index(step) for step in steps)
    assert max(lines.index(step) for step in steps) < text
    compiling = [i for i, line in enumerate(lines) if line.startswith("compiling ")]
    assert all(i < text for i in compiling), lines
