"""The merge memo: recovered merges kept on disk give back exactly what recovering gives, are
keyed by the vocabulary and its ranks, and a damaged file is thrown away and recovered anew."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from qkv.models.gguf import merge_memo
from qkv.models.gguf.checkpoint import open_gguf
from qkv.models.gguf.tokenizer import derived_merges, read_gguf_tokenizer
from tests.models.gguf.test_tokenizer import sentencepiece_types, story, train_sentencepiece, write_gguf  # noqa: F401 (story: a fixture)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QKV_PREPARED_CACHE", raising=False)
    monkeypatch.setattr(merge_memo, "SMALLEST_VOCAB", 1)
    return tmp_path / "cache" / "merges"


def vocabulary(size: int = 400) -> tuple[list[str], dict[str, float]]:
    """Every piece of up to three letters of 'abcdefg' (cut many ways), ranked by length then order."""
    letters = "abcdefg"
    tokens = list(letters)
    tokens += [a + b for a in letters for b in letters]
    tokens += [a + b + c for a in letters for b in letters for c in letters][: size - len(tokens)]
    return tokens, {t: -float(i) for i, t in enumerate(tokens)}


def counting(calls: list[int]):
    def derive(tokens, rank):
        calls.append(1)
        return derived_merges(tokens, rank)
    return derive


def test_the_second_recovery_is_read_and_equal(cache: Path) -> None:
    tokens, rank = vocabulary()
    calls: list[int] = []
    first = merge_memo.remembered_merges(tokens, rank, counting(calls))
    second = merge_memo.remembered_merges(tokens, rank, counting(calls))
    assert first == second == derived_merges(tokens, rank)
    assert len(first) > len(tokens)  # three-letter pieces cut two ways
    assert calls == [1]
    assert len(list(cache.glob("*.bin"))) == 1


def test_other_ranks_or_tokens_get_their_own_entry(cache: Path) -> None:
    tokens, rank = vocabulary()
    other_rank = {t: -r for t, r in rank.items()}  # reversed: another merge order
    fewer = tokens[:-1]
    keys = {merge_memo.memo_key(t, r, derived_merges)
            for t, r in ((tokens, rank), (tokens, other_rank), (fewer, {t: rank[t] for t in fewer}))}
    assert len(keys) == 3
    assert merge_memo.remembered_merges(tokens, other_rank, derived_merges) == derived_merges(tokens, other_rank)
    assert merge_memo.remembered_merges(tokens, rank, derived_merges) == derived_merges(tokens, rank)
    assert len(list(cache.glob("*.bin"))) == 2


@pytest.mark.parametrize("damage", ["flip", "cut", "bad ids"])
def test_a_damaged_memo_is_discarded_and_recovered(cache: Path, capsys, damage: str) -> None:
    tokens, rank = vocabulary()
    merge_memo.remembered_merges(tokens, rank, counting([]))  # the key names the recovering code: the same here
    (path,) = cache.glob("*.bin")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "cut":
        data = data[:-5]
    else:  # a well-formed file whose ids run past the vocabulary: checksum right, contents wrong
        body = (len(tokens) + 7).to_bytes(4, "little") * 2 + bytes(data[40:])
        data = bytearray(hashlib.sha256(body).digest() + body)
    path.write_bytes(bytes(data))
    calls: list[int] = []
    assert merge_memo.remembered_merges(tokens, rank, counting(calls)) == derived_merges(tokens, rank)
    assert calls == [1]
    assert "qkv: discarded" in capsys.readouterr().err
    assert merge_memo._decode(path.read_bytes(), tokens) == derived_merges(tokens, rank)  # written anew


def test_kept_only_when_asked_and_when_large(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, rank = vocabulary()
    monkeypatch.setenv("QKV_PREPARED_CACHE", "0")
    assert merge_memo.remembered_merges(tokens, rank, derived_merges) == derived_merges(tokens, rank)
    assert not cache.exists()
    monkeypatch.delenv("QKV_PREPARED_CACHE")
    monkeypatch.setattr(merge_memo, "SMALLEST_VOCAB", len(tokens) + 1)
    merge_memo.remembered_merges(tokens, rank, derived_merges)
    assert not cache.exists()


def test_only_the_most_recent_are_kept(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge_memo, "KEEP", 2)
    tokens, rank = vocabulary()
    for shift in range(4):
        merge_memo.remembered_merges(tokens, {t: r + shift * 1000 * (i % 2) for i, (t, r) in enumerate(rank.items())},
                                     derived_merges)
    assert len(list(cache.glob("*.bin"))) == 2


def test_a_sentencepiece_file_reads_the_same_ids_from_the_memo(cache: Path, tmp_path: Path, story: list[str]) -> None:
    """A real SentencePiece vocabulary (no merges listed) in a GGUF file: the tokenizer built
    while recovering and the one built from the memo encode alike, and equal SentencePiece."""
    sp = train_sentencepiece(story, gemma=False, prefix=True)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    path = write_gguf(tmp_path / "t.gguf", "llama", "llama", pieces, sentencepiece_types(sp),
                      scores=[sp.get_score(i) for i in range(len(pieces))], bos=sp.bos_id(), eos=sp.eos_id(),
                      unk=sp.unk_id(), add_bos=False, add_eos=False, add_space_prefix=True)
    fresh = read_gguf_tokenizer(open_gguf(path), path).tokenizer
    assert len(list(cache.glob("*.bin"))) == 1
    remembered = read_gguf_tokenizer(open_gguf(path), path).tokenizer
    for text in [*story[:20], "the key 12 meets the query", "queries 4711 and keys"]:
        assert remembered.encode(text).ids == fresh.encode(text).ids == sp.encode(text)
