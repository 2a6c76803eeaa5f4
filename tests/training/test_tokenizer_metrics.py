"""The trained BPE round-trips text; bad tokenizer files are QkvErrors; metrics survive
torn lines; the loss plot is a real PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.training.metrics import MetricsLog, plot_losses
from qkv.training.tokenizer import END_OF_TEXT, encode, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def bpe(verdict_text: str):
    return train_bpe(verdict_text[:8000], 400)


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_byte_level_bpe_round_trips_any_text(bpe, text: str) -> None:
    assert bpe.decode(encode(bpe, text)) == text


def test_bpe_learns_merges_and_keeps_end_of_text(bpe, verdict_text: str) -> None:
    assert bpe.get_vocab_size() == 400
    assert bpe.token_to_id(END_OF_TEXT) is not None
    sample = verdict_text[:2000]
    assert len(encode(bpe, sample)) < 0.7 * len(sample.encode("utf-8"))  # merges compress


def test_chunked_encoding_matches_whole_text_on_line_boundaries(bpe, verdict_text: str) -> None:
    text = verdict_text[:6000]
    whole = bpe.decode(encode(bpe, text))
    assert bpe.decode(encode(bpe, text, chunk_chars=500)) == whole == text


def test_saved_tokenizer_loads_and_bad_files_do_not(tmp_path: Path, bpe) -> None:
    good = tmp_path / "tokenizer.json"
    bpe.save(str(good))
    assert load_tokenizer(good).encode("Every effort").ids == bpe.encode("Every effort").ids
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(QkvError, match="not a tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(QkvError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")


def test_metrics_skip_a_torn_line_and_trim_on_resume(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (0, 5, 10):
        log.append({"step": s, "tokens_seen": s * 8, "train_loss": 5.0 - s / 10, "val_loss": 5.1})
    with open(log.path, "a") as handle:
        handle.write('{"step": 15, "tok')  # a crash mid-line
    assert [r["step"] for r in log.read()] == [0, 5, 10]
    log.keep_until(5)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [0, 5]


def test_loss_plot_is_a_png(tmp_path: Path) -> None:
    records = [
        {"step": s, "tokens_seen": 64 * s, "train_loss": 6 - s / 5, "val_loss": 6 - s / 8} for s in range(0, 20, 4)
    ]
    path = tmp_path / "loss.png"
    plot_losses(records, path, title="t")
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn
