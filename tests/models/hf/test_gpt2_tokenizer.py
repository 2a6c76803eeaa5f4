"""qkv's offline GPT-2 tokenizer against tiktoken's `gpt2` encoding built offline from the
same packaged rank file, on the book's text and on generated text; and the book's printed ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.models.hf.gpt2_tokenizer import END_OF_TEXT, END_OF_TEXT_ID, VOCAB_SIZE, gpt2_tokenizer, ranks_path, read_ranks

tiktoken = pytest.importorskip("tiktoken")
VERDICT = Path(__file__).resolve().parents[4] / "shared" / "data" / "the-verdict.txt"


@pytest.fixture(scope="module")
def ours():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def reference():
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str  # tiktoken's gpt2 pattern

    return tiktoken.Encoding(
        name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=load_tiktoken_bpe(str(ranks_path())),
        special_tokens={END_OF_TEXT: END_OF_TEXT_ID}, explicit_n_vocab=VOCAB_SIZE,
    )


def test_vocabulary_is_gpt2s(ours):
    assert ours.get_vocab_size() == VOCAB_SIZE
    assert ours.token_to_id(END_OF_TEXT) == END_OF_TEXT_ID


def test_book_chapter2_ids(ours):
    # The book prints these ids for its chapter-2 example (section 2.5).
    text = "Hello, do you like tea? <|endoftext|> In the sunlit terraces of someunknownPlace."
    assert ours.encode(text).ids == [
        15496, 11, 466, 345, 588, 8887, 30, 220, 50256, 554, 262, 4252, 18250, 8812, 2114, 286, 617,
        34680, 27271, 13,
    ]


@pytest.mark.skipif(not VERDICT.is_file(), reason="the-verdict.txt is not in ../shared/data")
def test_the_verdict_equals_tiktoken(ours, reference):
    text = VERDICT.read_text(encoding="utf-8")
    ids = ours.encode(text, add_special_tokens=False).ids
    assert len(ids) == 5145  # the book's count
    assert ids == reference.encode(text)
    assert ours.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=80)
       | st.text(alphabet=" \n\t'sdtmlvrehHELLO0123456789,.!?-é中😀", max_size=60))
def test_any_text_equals_tiktoken(ours, reference, text):
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode(text, allowed_special={END_OF_TEXT})
    assert ours.decode(ids) == text


def test_a_damaged_rank_file_is_refused(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(b"not-base64!! 0\n")
    with pytest.raises(QkvError, match="line 1"):
        read_ranks(bad)
    short = tmp_path / "short.tiktoken"
    short.write_bytes(b"IQ== 0\n")
    with pytest.raises(QkvError, match="50,256 ranks"):
        read_ranks(short)
