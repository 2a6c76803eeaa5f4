"""The trained byte-level BPE round-trips any text and compresses; bad tokenizer files are QkvErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.training.tokenizer import END_OF_TEXT, encode, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def bpe(verdict_text: str):
    return train_bpe(verdict_text[:8000], 400)


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
@example("a<|endoftext|>b")
def test_byte_level_bpe_round_trips_any_text(bpe, text: str) -> None:
    # Hypothesis also tries the literal "<|endoftext|>": it is the special token, kept on decode.
    assert bpe.decode(encode(bpe, text), skip_special_tokens=False) == text


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
