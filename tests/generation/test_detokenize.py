"""qkv.generation.detokenize: the incremental text equals decoding everything at once.

References: the tokenizer's own decode of all the ids (SmolLM2's packaged byte-level BPE, and
a tiny byte-level BPE whose few merges leave multi-byte characters split over byte tokens),
and a plain `str.find` of the stop strings in that whole text."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from qkv.generation.detokenize import TextStream, special_ids


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from qkv.models.gguf.checkpoint import open_gguf_file
    from qkv.models.loader import smollm2_path

    return open_gguf_file(smollm2_path()).tokenizer


@functools.lru_cache(maxsize=1)
def split_bytes_tokenizer() -> Tokenizer:
    """Byte-level BPE with so few merges that é, 你, 🎉 are 2-4 tokens of one byte each."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "café 你好 🎉 déjà"], trainer)
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    return tok


TOKENIZERS = {"smollm2": smollm2_tokenizer, "split-bytes": split_bytes_tokenizer}


def streamed(tokenizer, ids: list[int], stop: list[str] = (), context: list[int] = ()) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stop, context)
    chunks = []
    for token in ids:
        chunks.append(stream.push(token))
        if stream.stopped:
            break
    chunks.append(stream.flush())
    return chunks, stream


@functools.lru_cache(maxsize=None)
def single_byte_ids(name: str) -> list[int]:
    """The ids whose token is one character (one byte of byte-level BPE): listed once per
    tokenizer, not at every example drawn (SmolLM2's 49,152 ids took most of the test's time)."""
    tokenizer = TOKENIZERS[name]()
    return [i for i in range(tokenizer.get_vocab_size()) if len(tokenizer.id_to_token(i) or "") == 1]


@st.composite
def token_ids(draw, name: str) -> list[int]:
    """Random ids, often from the single-byte tokens, so characters split and bytes go invalid."""
    size = TOKENIZERS[name]().get_vocab_size()
    one = st.one_of(st.integers(0, size - 1), st.sampled_from(single_byte_ids(name)))
    return draw(st.lists(one, max_size=40))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_chunks_join_to_the_decoding_of_all_ids(name: str) -> None:
    tokenizer = TOKENIZERS[name]()

    @settings(max_examples=300, deadline=None)
    @given(token_ids(name))
    def check(ids: list[int]) -> None:
        chunks, stream = streamed(tokenizer, ids)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(chunks) == whole
        assert stream.sent == stream.text_length == len(whole)

    check()


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_no_chunk_ends_in_half_a_character_that_completes_later(name: str) -> None:
    """Held-back bytes: a character split over tokens comes out whole, in one chunk."""
    tokenizer = TOKENIZERS[name]()
    text = "naïve café — 你好 🎉🎉 déjà vu ✓"
    ids = tokenizer.encode(text).ids
    chunks, _ = streamed(tokenizer, ids)
    assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)
    if name == "split-bytes":
        assert len(ids) > len(text)  # the characters really were split over tokens


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_decoded_length_is_that_of_the_ids_so_far(name: str) -> None:
    """What the server's logprobs count a token's text_offset from."""
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode("Hello wörld, 你好 🎉 again").ids
    stream = TextStream(tokenizer)
    for n, token in enumerate(ids, 1):
        stream.push(token)
        assert stream.decoded_length == len(tokenizer.decode(ids[:n], skip_special_tokens=True))


def test_context_gives_the_spacing_of_the_whole_sequence() -> None:
    tokenizer = smollm2_tokenizer()
    prompt = tokenizer.encode("The answer is").ids
    ids = tokenizer.encode("The answer is forty-two, naïvely 🎉").ids[len(prompt):]
    chunks, _ = streamed(tokenizer, ids, context=prompt[-4:])
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    assert "".join(chunks) == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]


def test_special_tokens_are_skipped_without_growing_the_window() -> None:
    tokenizer = split_bytes_tokenizer()
    end = tokenizer.token_to_id("<|end|>")
    ids = tokenizer.encode("café").ids
    mixed = [ids[0], *[end] * 50, *ids[1:]]
    stream = TextStream(tokenizer)
    chunks = [stream.push(t) for t in mixed]
    assert "".join(chunks) + stream.flush() == "café"
    assert len(stream._window) <= len(ids)  # noqa: SLF001 - the bound this test is about


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_special_ids_are_those_decoding_skips(name: str) -> None:
    """Read once per tokenizer, they are exactly the ids `decode(skip_special_tokens=True)`
    turns into nothing while decoding them kept gives text."""
    tokenizer = TOKENIZERS[name]()
    special = special_ids(tokenizer)
    assert special and special_ids(tokenizer) is special
    skipped = {i for i in range(tokenizer.get_vocab_size())
               if tokenizer.decode([i], skip_special_tokens=True) == "" and tokenizer.decode([i], skip_special_tokens=False)}
    assert special == skipped


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_strings_across_tokens_stop_where_the_whole_text_does(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    words = ["the", " cat", " sat", "é", "你", "🎉", " mat", "\n", "\n\n", "ca", "fé"]

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.sampled_from(words), max_size=14),
           st.lists(st.text(alphabet="thecatsé你🎉 \n", min_size=1, max_size=5), min_size=1, max_size=3))
    def check(pieces: list[str], stop: list[str]) -> None:
        ids = tokenizer.encode("".join(pieces)).ids
        chunks, stream = streamed(tokenizer, ids, stop)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        found = [at for at in (whole.find(s) for s in stop) if at != -1]
        assert "".join(chunks) == (whole[:min(found)] if found else whole)
        assert stream.stopped == bool(found)

    check()


def test_text_before_a_possible_stop_string_is_sent_at_once() -> None:
    """Only the last (longest stop - 1) characters wait: streaming is not held up by stops."""
    tokenizer = smollm2_tokenizer()
    stream = TextStream(tokenizer, stop=["<END>"])
    sent = "".join(stream.push(t) for t in tokenizer.encode("Hello there, my friend").ids)
    assert sent == "Hello there, my friend"[:-4] and stream.text_length == len("Hello there, my friend")
