"""Windows and batches against the book's construction and the sharding invariants; the
streamed corpus gives what reading the whole text gives (the reference: the in-memory
split, encode and TokenWindows), and `qkv train` on a large file holds a small fraction of
the file in memory."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import Tensor
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.models.hf.gpt2_tokenizer import gpt2_tokenizer
from qkv.training.data import (
    READ_BYTES,
    TRAIN_RATIO,
    WHEN_EMPTY,
    BatchSchedule,
    FileWindows,
    scan_corpus,
    tokenize_corpus,
)
from qkv.training.tokenizer import encode, train_bpe, train_bpe_from
from qkv.util.text_file import read_text_file


# The reference the streamed corpus is held to: the whole text read, split and windowed in memory,
# as qkv train did before it streamed.
def read_text(path: str | Path) -> str:
    return read_text_file(path, when_empty=WHEN_EMPTY)


def text_fingerprint(text: str) -> str:
    """A short hash so a resumed run can check it trains on the same data."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def split_text(text: str, train_ratio: float = TRAIN_RATIO) -> tuple[str, str]:
    """The book's split: the first 90% of the characters train, the rest validate."""
    cut = int(train_ratio * len(text))
    return text[:cut], text[cut:]


class TokenWindows:
    """Sliding (input, target) windows over one token sequence."""

    def __init__(self, ids: list[int] | Tensor, length: int, stride: int) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long)  # (tokens,)
        self.length = length
        self.stride = stride
        if self.ids.numel() < length + 1:
            self.windows = self.ids.new_empty((0, length + 1))
        else:
            self.windows = self.ids.unfold(0, length + 1, stride)  # (N, L + 1), a view

    def __len__(self) -> int:
        return self.windows.shape[0]

    def row(self, index: int) -> Tensor:
        """Window `index`: ids[index*stride : index*stride + L + 1], (L + 1,)."""
        return self.windows[index]

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        rows = self.windows[index]  # (B, L + 1)
        return rows[:, :-1], rows[:, 1:]  # inputs (B, L), targets (B, L)


def book_windows(ids: list[int], length: int, stride: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chapter 2's GPTDatasetV1 loop: inputs ids[i:i+L], targets ids[i+1:i+L+1]."""
    inputs, targets = [], []
    for i in range(0, len(ids) - length, stride):
        inputs.append(ids[i : i + length])
        targets.append(ids[i + 1 : i + length + 1])
    return inputs, targets


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 80), st.integers(1, 12), st.integers(1, 12))
def test_windows_equal_the_books_dataset(n: int, length: int, stride: int) -> None:
    ids = list(range(100, 100 + n))
    windows = TokenWindows(ids, length, stride)
    inputs, targets = book_windows(ids, length, stride)
    assert len(windows) == len(inputs)
    if inputs:
        x, y = windows.batch(torch.arange(len(windows)))
        assert x.tolist() == inputs
        assert y.tolist() == targets


def test_split_is_the_books_ninety_percent_of_characters() -> None:
    text = "abcdefghij" * 7
    train, val = split_text(text)
    assert train + val == text
    assert len(train) == int(0.9 * len(text))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 5), st.integers(1, 4), st.integers(0, 30))
def test_shards_make_up_the_single_process_batch(windows: int, batch: int, world: int, step: int) -> None:
    global_batch = batch * world
    assume(windows >= global_batch)
    sharded = BatchSchedule(windows, batch, world, seed=7)
    single = BatchSchedule(windows, global_batch, 1, seed=7)
    assert sharded.steps_per_epoch == single.steps_per_epoch
    ranks = torch.cat([sharded.indices(step, rank) for rank in range(world)])
    assert ranks.tolist() == single.indices(step, 0).tolist()


def test_an_epoch_visits_windows_once_and_epochs_reshuffle() -> None:
    schedule = BatchSchedule(num_windows=23, batch_size=4, world_size=1, seed=1)
    assert schedule.steps_per_epoch == 5  # the book drops the last, partial batch
    first = torch.cat([schedule.indices(s, 0) for s in range(5)])
    assert len(set(first.tolist())) == 20
    second = torch.cat([schedule.indices(s, 0) for s in range(5, 10)])
    assert first.tolist() != second.tolist()
    assert schedule.indices(7, 0).tolist() == schedule.indices(7, 0).tolist()  # order is a function of the step


# -- the streamed corpus ------------------------------------------------------------------


def _windows_equal(streamed: FileWindows, reference: TokenWindows) -> None:
    assert len(streamed) == len(reference) > 0
    for i in range(len(reference)):
        assert torch.equal(streamed.row(i), reference.row(i))
    index = torch.randperm(len(reference), generator=torch.Generator().manual_seed(0))[:8]
    for got, want in zip(streamed.batch(index), reference.batch(index)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("length", "stride"), [(256, 256), (64, 17)])
def test_streamed_windows_are_the_in_memory_windows_on_the_verdict(verdict_text: str, tmp_path: Path,
                                                                    length: int, stride: int) -> None:
    from tests.training.conftest import VERDICT

    corpus = scan_corpus(VERDICT, when_empty=WHEN_EMPTY)
    assert corpus.fingerprint == text_fingerprint(verdict_text)
    train_text, val_text = split_text(verdict_text)  # the book's 90/10 split by characters
    assert "".join(corpus.split("training")) == train_text and "".join(corpus.split("validation")) == val_text
    tokenizer = gpt2_tokenizer()  # the book presets' tokenizer
    train_ids, val_ids = tokenize_corpus(corpus, tokenizer, tmp_path, progress=False)
    _windows_equal(FileWindows(train_ids, length, stride), TokenWindows(encode(tokenizer, train_text), length, stride))
    _windows_equal(FileWindows(val_ids, 16, 16), TokenWindows(encode(tokenizer, val_text), 16, 16))
    assert list(tmp_path.iterdir()) == []  # the token files have no names


def test_a_bpe_trained_on_the_stream_is_the_one_trained_on_the_text(verdict_text: str) -> None:
    from tests.training.conftest import VERDICT

    corpus = scan_corpus(VERDICT, when_empty=WHEN_EMPTY)
    train_text, _ = split_text(verdict_text)
    assert not corpus.sampled_for_bpe
    assert train_bpe_from(corpus.bpe_sample(), 400).to_str() == train_bpe(train_text, 400).to_str()


def test_the_stream_is_the_text_python_reads(tmp_path: Path) -> None:
    """CR LF and lone CR become LF, and characters of several bytes straddle the reads."""
    path = tmp_path / "mixed.txt"
    unit = "naïve 東京 \u2603 \U0001f600\r\nline\rend\n"
    path.write_bytes((unit * (3 * READ_BYTES // len(unit.encode()) + 7)).encode("utf-8"))
    corpus = scan_corpus(path, when_empty=WHEN_EMPTY)
    text = read_text(path)
    assert corpus.characters == len(text) and corpus.fingerprint == text_fingerprint(text)
    assert "".join(corpus.chunks()) == text
    assert "".join(corpus.chunks(5, READ_BYTES + 11)) == text[5 : READ_BYTES + 11]


@pytest.mark.parametrize("data", [b"", b" \n\t ", b"ok " * (READ_BYTES // 3) + b"\xff tail", b"\xc3"],
                         ids=["empty", "blank", "bad-byte-after-a-read", "cut-character"])
def test_bad_files_give_the_messages_of_reading_the_whole_file(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    with pytest.raises(QkvError) as whole:
        read_text(path)
    with pytest.raises(QkvError) as streamed:
        scan_corpus(path, when_empty=WHEN_EMPTY)
    assert str(streamed.value) == str(whole.value)


WORDS = 20
BIG_BYTES = 64 << 20


def _write_corpus(path: Path, size: int) -> None:
    """Lines of a few long words (a trained BPE makes each one token, so tokenizing is fast)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(11)) for _ in range(WORDS)]
    block = "".join(" ".join(rng.choices(words, k=60)) + "\n" for _ in range(2000)).encode()
    with path.open("wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)


def _peak_rss(argv: list[str]) -> int:
    """The peak resident set of a `qkv train` run, in bytes (the kernel's count, wait4)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    process = subprocess.Popen([sys.executable, "-m", "qkv", "train", *argv], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0, process.stderr.read().decode() if process.stderr else ""
    return usage.ru_maxrss * 1024


@pytest.mark.slow  # two `qkv train` processes over a 64 MB corpus: 26-40 s on a loaded machine
def test_a_large_corpus_trains_in_memory_a_small_fraction_of_its_size(tmp_path: Path) -> None:
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    _write_corpus(big, BIG_BYTES)
    _write_corpus(small, 2 << 20)
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(small.read_text()[:200_000], 1024).save(str(tokenizer))
    common = ["--tokenizer", str(tokenizer), "--max-steps", "1", "--context-length", "32", "--emb-dim", "32",
              "--n-layers", "1", "--n-heads", "2", "--batch-size", "2", "--eval-every", "1", "--no-progress",
              "--threads", "1"]
    start = time.monotonic()
    base = _peak_rss(["--data", str(small), "--out", str(tmp_path / "a"), *common])
    peak = _peak_rss(["--data", str(big), "--out", str(tmp_path / "b"), *common])
    growth = peak - base
    print(f"peak RSS {base / 1e6:.0f} MB -> {peak / 1e6:.0f} MB for a {BIG_BYTES / 1e6:.0f} MB corpus "
          f"in {time.monotonic() - start:.1f} s")
    assert growth < BIG_BYTES / 4, f"the run grew by {growth / 1e6:.0f} MB for a {BIG_BYTES / 1e6:.0f} MB file"
