"""`qkv train` from the command line: bad input is one line and exit code 2 with nothing
lost; a real Ctrl-C (SIGINT) keeps the last checkpoint and --resume finishes the run."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qkv.cli.main import main
from qkv.training.checkpoint import load_checkpoint

VERDICT = Path(__file__).resolve().parents[3] / "shared" / "data" / "the-verdict.txt"
FAST = ["--context-length", "16", "--batch-size", "4", "--eval-every", "2", "--no-progress"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def story(tmp_path: Path) -> Path:
    assert VERDICT.is_file(), f"the test data {VERDICT} is missing"
    path = tmp_path / "story.txt"
    path.write_text(VERDICT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return path


def fails(capsys: pytest.CaptureFixture[str], *argv: str, match: str) -> None:
    """Exit code 2, exactly one line on stderr that says `match`, no traceback."""
    capsys.readouterr()
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkv train: error:"), err
    assert match in err, err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_bad_data_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fails(capsys, "--data", str(empty), "--out", str(tmp_path / "a" / "run"), *FAST, match="is empty")
    assert not (tmp_path / "a").exists()  # no empty folder left behind, nor its new parent
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    (tmp_path / "b").mkdir()
    fails(capsys, "--data", str(short), "--out", str(tmp_path / "b" / "run"), *FAST, match="fewer than one window")
    assert list((tmp_path / "b").iterdir()) == []  # the folder that was there stays
    fails(capsys, "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "c"), *FAST, match="does not exist")


def test_unwritable_out_and_bad_tokenizer(story: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    fails(capsys, "--data", str(story), "--out", str(blocker / "run"), *FAST, match="cannot write to --out")
    fails(capsys, "--data", str(story), "--out", str(blocker), *FAST, match="is a file")
    assert blocker.read_text() == "keep me"
    fails(capsys, "--data", str(story), "--out", str(tmp_path / "r"), "--tokenizer", str(story), *FAST,
          match="not a tokenizer.json")


def test_resume_without_checkpoint(story: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, "--data", str(story), "--out", str(tmp_path / "fresh"), "--resume", *FAST,
          match="no training checkpoint")


def test_existing_run_is_neither_overwritten_nor_resumed_from_a_corrupt_file(
    story: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--data", str(story), "--out", str(out), "--max-steps", "2", *FAST]) == 0
    before = snapshot(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "checkpoint.safetensors",
            "metrics.jsonl", "loss.png"} <= before.keys()
    assert main(["explain", "Every effort moves you", "--model", str(out)]) == 0  # a model folder
    capsys.readouterr()
    frozen = gc.get_freeze_count()
    assert main(["generate", "--model", str(out), "--prompt", "Every effort", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Every effort")
    assert gc.get_freeze_count() == frozen  # the command's frozen heap given back to this process's collector
    fails(capsys, "--data", str(story), "--out", str(out), "--max-steps", "2", *FAST, match="--resume")
    fails(capsys, "--data", str(story), "--out", str(out), "--resume", "--lr", "0.5", *FAST,
          match="lr was")
    assert snapshot(out) == before

    checkpoint = out / "checkpoint.safetensors"
    checkpoint.write_bytes(before["checkpoint.safetensors"][:-100])
    corrupt = snapshot(out)
    fails(capsys, "--data", str(story), "--out", str(out), "--resume", "--max-steps", "4", *FAST,
          match="corrupt")
    assert snapshot(out) == corrupt


@pytest.mark.slow
def test_sigint_keeps_the_last_checkpoint_and_resume_finishes(story: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv", "train", "--data", str(story), "--out", str(out),
         "--max-steps", "100000", "--save-every", "1", *FAST],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from a terminal: Ctrl-C raises KeyboardInterrupt. A process started with SIGINT
        # ignored (as a test worker's children may be) keeps ignoring it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    checkpoint = out / "checkpoint.safetensors"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # let it be mid-way through later steps and saves
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    step = load_checkpoint(checkpoint).state.step  # whole and readable
    assert step >= 1
    assert main(["train", "--data", str(story), "--out", str(out), "--resume",
                 "--max-steps", str(step + 2), *FAST]) == 0
    assert load_checkpoint(checkpoint).state.step == step + 2


def test_a_finished_run_resumed_says_it_is_complete(story: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--data", str(story), "--out", str(out), "--max-steps", "2", *FAST]) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(["train", "--data", str(story), "--out", str(out), "--resume", *FAST]) == 0
    said = capsys.readouterr().out
    assert "already complete: 2 of 2 steps" in said and "nothing to train" in said
    assert "--max-steps" in said and "validation loss" not in said
    assert snapshot(out) == before
    fails(capsys, "--data", str(story), "--out", str(out), "--resume", "--max-steps", "1", *FAST,
          match="already trained 2 steps, more than the 1")
    assert snapshot(out) == before


def test_the_progress_bar_stays_out_of_a_pipe(story: Path, tmp_path: Path) -> None:
    fast = [a for a in FAST if a != "--no-progress"]
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "train", "--data", str(story), "--out", str(tmp_path / "run"),
         "--max-steps", "3", "--threads", "1", *fast],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "\r" not in result.stdout
    assert "step      3" in result.stdout
