"""The loop end to end on real text: loss falls, resume is exact, the output folder is a
model that qkv and transformers load, and 2 processes equal 1 with the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from qkv.models.loader import load_pretrained
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.training import TrainSettings, train
from qkv.training.checkpoint import load_checkpoint
from qkv.training.tokenizer import train_bpe

FAST = dict(context_length=16, batch_size=4, eval_windows=8, dropout=0.1, warmup_steps=2)


def settings(data: Path, out: Path, **changes) -> TrainSettings:
    return TrainSettings.from_preset("tiny", data=str(data), out=str(out), **{**FAST, **changes})


def losses(out: Path) -> list[tuple[int, int, float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["tokens_seen"], r["train_loss"], r["val_loss"]) for r in rows]


def trained_model(out: Path) -> GPT2Decoder:
    checkpoint = load_checkpoint(out / "checkpoint.safetensors")
    model = GPT2Decoder(GPTConfig(**checkpoint.state.model_config))
    model.load_state_dict(checkpoint.model)
    return model.eval()


def test_training_lowers_the_loss_and_writes_its_files(story_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = train(settings(story_file, out, max_steps=24, eval_every=8, lr=3e-3), progress=False)
    rows = losses(out)
    assert [r[0] for r in rows] == [0, 8, 16, 24]
    assert [r[1] for r in rows] == [0, 8 * 64, 16 * 64, 24 * 64]  # batch 4 x 16 tokens per step
    assert rows[-1][2] < rows[0][2] - 0.5 and rows[-1][3] < rows[0][3] - 0.5
    assert result.step == 24
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(isinstance(r["sample"], str) for r in result.records)


def test_output_folder_loads_in_qkv_and_transformers(story_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(settings(story_file, out, max_steps=3), progress=False)
    model = trained_model(out)
    ids = torch.tensor([[5, 77, 300, 12, 9, 41]])
    with torch.no_grad():
        expected = model(ids)
        loaded, tokenizer = load_pretrained(out)
        torch.testing.assert_close(loaded(ids), expected)
        hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
        torch.testing.assert_close(hf(ids).logits, expected, rtol=1e-4, atol=1e-4)
    reference = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.encode("Every effort moves you").ids == reference.encode("Every effort moves you").ids


def test_resume_after_an_interruption_matches_an_unbroken_run(story_file: Path, tmp_path: Path) -> None:
    run = dict(max_steps=7, eval_every=2, save_every=3)
    whole = tmp_path / "whole"
    train(settings(story_file, whole, **run), progress=False)

    broken = tmp_path / "broken"

    def ctrl_c_at_step_5(step: int) -> None:
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(settings(story_file, broken, **run), on_step=ctrl_c_at_step_5, progress=False)
    assert load_checkpoint(broken / "checkpoint.safetensors").state.step == 3
    assert [r[0] for r in losses(broken)] == [0, 2, 4]  # step 4 was evaluated after the save

    train(settings(story_file, broken, **run), resume=True, progress=False)
    assert losses(broken) == losses(whole)  # bitwise: same floats, same steps, step 4 redone
    a = load_file(str(whole / "model.safetensors"))
    b = load_file(str(broken / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure_lines(stderr: str) -> str:
    """A failed rank's own error, which torchrun's summary at the end would push out of view."""
    keys = ("Error", "error", "terminate", "Exception", "Traceback", "Signal")
    return "\n".join(line for line in stderr.splitlines() if any(k in line for k in keys))[-4000:]


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(story_file: Path, tmp_path: Path) -> None:
    common = ["--data", str(story_file), "--context-length", "16", "--dropout", "0", "--max-steps", "4",
              "--eval-every", "2", "--save-every", "4", "--warmup-steps", "1", "--no-progress"]
    one = tmp_path / "one"
    train(settings(story_file, one, batch_size=4, dropout=0.0, max_steps=4, eval_every=2,
                   save_every=4, warmup_steps=1, eval_windows=64), progress=False)

    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), "-m", "qkv", "train", "--out", str(two),
         "--batch-size", "2", *common],
        env=env, capture_output=True, text=True, timeout=240,  # bounded; 15 s when quiet
    )
    assert done.returncode == 0, _failure_lines(done.stderr)
    assert done.stdout.count("val loss") == 3  # only rank 0 prints
    single, double = losses(one), losses(two)
    assert [r[:2] for r in double] == [r[:2] for r in single]
    torch.testing.assert_close(torch.tensor([r[2:] for r in double]), torch.tensor([r[2:] for r in single]))
    a = load_file(str(one / "model.safetensors"))
    b = load_file(str(two / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
    assert load_checkpoint(two / "checkpoint.safetensors").state.world_size == 2


def test_a_given_tokenizer_is_used_and_kept(story_file: Path, tmp_path: Path, verdict_text: str) -> None:
    given = tmp_path / "given.json"
    train_bpe(verdict_text, 700).save(str(given))
    out = tmp_path / "run"
    train(settings(story_file, out, max_steps=1, tokenizer=str(given)), progress=False)
    kept = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert kept.get_vocab() == Tokenizer.from_file(str(given)).get_vocab()
    assert trained_model(out).cfg.vocab_size == 700


def test_bfloat16_autocast_trains_near_float32(story_file: Path, tmp_path: Path) -> None:
    run = dict(max_steps=4, eval_every=4, dropout=0.0)
    train(settings(story_file, tmp_path / "fp32", **run), progress=False)
    train(settings(story_file, tmp_path / "bf16", dtype="bfloat16", **run), progress=False)
    fp32, bf16 = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    torch.testing.assert_close(torch.tensor([r[2:] for r in bf16]), torch.tensor([r[2:] for r in fp32]),
                               rtol=0, atol=0.05)
    assert bf16 != fp32  # the matrix products really ran in bf16
    assert trained_model(tmp_path / "bf16").tok_emb.weight.dtype == torch.float32  # fp32 master weights


def lrs(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["lr"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_extending_a_finished_run_trains_on_at_the_floor_and_resumes_exactly(story_file: Path, tmp_path: Path) -> None:
    run = dict(warmup_steps=2, eval_every=1, save_every=2, dropout=0.0)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    for out in (whole, broken):
        train(settings(story_file, out, max_steps=6, **run), progress=False)
    floor = settings(story_file, whole).lr * settings(story_file, whole).min_lr_ratio
    assert lrs(whole)[-1] == (6, pytest.approx(floor))
    train(settings(story_file, whole, max_steps=10, **run), resume=True, progress=False)
    rates = [lr for _, lr in lrs(whole)]
    assert [step for step, _ in lrs(whole)] == list(range(11))
    assert rates[6:] == pytest.approx([floor] * 5)  # no jump back up: a constant tail at the floor
    assert all(a >= b for a, b in zip(rates[2:], rates[3:]))

    def ctrl_c_at_step_9(step: int) -> None:
        if step == 9:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(settings(story_file, broken, max_steps=10, **run), resume=True, on_step=ctrl_c_at_step_9,
              progress=False)
    train(settings(story_file, broken, max_steps=10, **run), resume=True, progress=False)
    assert losses(broken) == losses(whole) and lrs(broken) == lrs(whole)


def test_extending_an_unfinished_run_decays_from_where_it_is(story_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"

    def stop_at_4(step: int) -> None:
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(settings(story_file, out, max_steps=8, eval_every=1, save_every=4), on_step=stop_at_4,
              progress=False)
    reached = dict(lrs(out))[4]
    train(settings(story_file, out, max_steps=12, eval_every=1, save_every=4), resume=True, progress=False)
    rates = dict(lrs(out))
    assert rates[4] == reached  # evaluated again after the resume, same rate
    assert rates[5] < reached and rates[12] == pytest.approx(settings(story_file, out).lr * 0.1)
    assert all(rates[s] >= rates[s + 1] for s in range(4, 12))
