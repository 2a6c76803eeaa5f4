"""qkv.models.hf.tokenizer_guard: the static growth bound holds for what the Rust normalizer
really makes (hypothesis over texts), chains past the bound are refused at load, the
measured bound refuses a text before the encode allocates, a panicking regex is one
QkvError, and a guarded tokenizer encodes and decodes exactly as the tokenizer it wraps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from qkv.errors import QkvError
from qkv.models.hf import tokenizer_guard
from qkv.models.hf.tokenizer_guard import BoundedTokenizer, TokenizerPanicError, guard, normalizer_growth

CHAINS = {
    "llama2": normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
    "bert": normalizers.BertNormalizer(lowercase=True),
    "nfkc-lower": normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
    "replace-regex": normalizers.Replace(Regex("a*"), "<>"),
    "replace-40": normalizers.Replace("o", "o" * 40),
}


def _tokenizer(normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Your journey starts with one step. naïve café 東京"],
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


@pytest.mark.parametrize("name", list(CHAINS))
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_the_static_bound_holds_for_what_the_normalizer_makes(name: str, text: str) -> None:
    import json

    tok = _tokenizer(CHAINS[name])
    growth = normalizer_growth(json.loads(tok.to_str())["normalizer"])
    made = tok.normalizer.normalize_str(text)
    assert len(made.encode("utf-8", "surrogatepass")) <= growth.bound(len(text.encode("utf-8", "surrogatepass")))


def test_a_chain_past_the_bound_is_refused_naming_its_steps() -> None:
    tok = _tokenizer(normalizers.Sequence([normalizers.Replace("o", "o" * 40)] * 5))
    with pytest.raises(QkvError, match=r"can grow text 102,400,000 times .*Replace\('o' -> 40 bytes\)"):
        guard(tok, "bomb")
    decoding = _tokenizer()
    decoding.decoder = decoders.Sequence([decoders.Replace("o", "o" * 40)] * 3)
    with pytest.raises(QkvError, match="its decoder can grow text 64,000 times"):
        guard(decoding, "bomb")


def test_a_text_that_would_grow_past_the_bound_is_refused_before_encoding(monkeypatch) -> None:
    guarded = guard(_tokenizer(normalizers.Replace("o", "o" * 40)), "one step")
    called = []
    monkeypatch.setattr(tokenizer_guard, "MAX_ENCODE_BYTES", 100_000)
    inner_encode = guarded.inner.encode
    object.__setattr__(guarded, "inner", type("Spy", (), {
        "encode": lambda self, *a, **k: called.append(1) or inner_encode(*a, **k),
        "normalizer": guarded.inner.normalizer})())
    with pytest.raises(QkvError, match="would grow this 5,000-byte text past 100,000 bytes"):
        guarded.check_size("o" * 5000, limit=100_000)
    guarded.check_size("x" * 5000, limit=100_000)  # the same size without the expanding letter fits
    assert called == []


def test_a_backtracking_regex_is_refused_at_load_and_a_panic_is_one_error() -> None:
    tok = _tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(a|aa)+$"), "isolated")
    with pytest.raises(QkvError, match="backtracks exponentially"):
        guard(tok, "split")
    unchecked = BoundedTokenizer(tok, normalizer=normalizer_growth(None), pre_tokenizer=normalizer_growth(None),
                                 trap=True, source="split")
    with pytest.raises(TokenizerPanicError, match="retry-limit"):
        unchecked.encode("a" * 40 + "!")


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=60))
def test_a_guarded_tokenizer_encodes_and_decodes_as_the_one_it_wraps(text: str) -> None:
    plain = _tokenizer(CHAINS["llama2"])
    guarded = guard(plain, "llama2")
    assert guarded.encode(text).ids == plain.encode(text).ids
    ids = plain.encode(text).ids
    assert guarded.decode(ids) == plain.decode(ids)
    assert guarded.get_vocab_size() == plain.get_vocab_size()


def test_a_large_text_of_ones_own_encodes_but_may_not_grow_past_four_times_itself() -> None:
    plain = guard(_tokenizer(), "plain")
    plain.check_size("x" * (3 << 20))  # 3 MiB that stays 3 MiB: past 2 MiB, within 4x itself
    growing = guard(_tokenizer(normalizers.Replace("o", "o" * 40)), "one step")
    growing.check_size("x" * (3 << 20))
    with pytest.raises(QkvError, match="past 12,582,912 bytes"):
        growing.check_size("o" * (3 << 20))
