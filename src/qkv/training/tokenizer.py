"""The run's tokenizer: a byte-level BPE trained on the data, or a given tokenizer.json.

Byte-level BPE (GPT-2's scheme) encodes any text without unknown tokens, so a model
trained with it can continue any prompt. The tokenizer is trained on the training split
only, so the validation split stays unseen.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qkv.errors import QkvError
from qkv.models.hf.tokenizer_guard import BoundedTokenizer, guard

MAX_TOKENIZER_BYTES = 512 * 2**20
ENCODE_PIECE_CHARS = 1 << 20  # encode's pieces: at least this long, up to the next newline  # as for a model folder's tokenizer.json

END_OF_TEXT = "<|endoftext|>"
# what train_bpe builds, as tokenizer.json spells it (for qkv.models.hf.tokenizer_guard)
TRAINED_PIPELINE = {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"}}


def train_bpe(text: str, vocab_size: int) -> Tokenizer:
    """Learn byte-level BPE merges from `text` up to `vocab_size` entries."""
    return train_bpe_from(_lines(text), vocab_size)


def train_bpe_from(pieces: Iterable[str], vocab_size: int) -> Tokenizer:
    """train_bpe on a text given as pieces (a stream: qkv.training.data.CorpusText.bpe_sample)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    return tokenizer


def _lines(text: str, chunk: int = 1 << 16) -> list[str]:
    # The trainer counts words per item; feeding pieces keeps memory flat on large files.
    return [text[i : i + chunk] for i in range(0, len(text), chunk)] or [""]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a `tokenizers` tokenizer.json, turning every failure into a QkvError."""
    p = Path(path)
    if not p.is_file():
        raise QkvError(f"tokenizer file {p} does not exist; give a tokenizer.json made by `tokenizers`")
    if p.stat().st_size > MAX_TOKENIZER_BYTES:
        raise QkvError(f"{p} is {p.stat().st_size:,} bytes; qkv reads tokenizers up to {MAX_TOKENIZER_BYTES:,}")
    try:
        tokenizer = Tokenizer.from_file(str(p))
    except Exception as error:  # tokenizers raises a bare Exception on bad JSON
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise QkvError(f"{p} is not a tokenizer.json that `tokenizers` can read ({first})") from None
    except BaseException as error:  # a pyo3 panic while reading
        if type(error).__name__ != "PanicException":
            raise
        raise QkvError(f"{p} is not a tokenizer.json that `tokenizers` can read (it panicked)") from None
    if tokenizer.get_vocab_size() < 2:
        raise QkvError(f"{p} holds a tokenizer with an empty vocabulary")
    return guard(tokenizer, str(p))


def encode(tokenizer: Tokenizer | BoundedTokenizer, text: str, chunk_chars: int = ENCODE_PIECE_CHARS) -> list[int]:
    """Token ids of `text`; large texts are encoded in line-aligned pieces, in parallel. A
    given tokenizer (BoundedTokenizer) may grow each piece only as far as
    qkv.models.hf.tokenizer_guard.limit_for allows."""
    if len(text) <= chunk_chars:
        return encode_pieces(tokenizer, [text])[0]
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + chunk_chars)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    ids: list[int] = []
    for piece_ids in encode_pieces(tokenizer, pieces):
        ids.extend(piece_ids)
    return ids


def encode_pieces(tokenizer: Tokenizer | BoundedTokenizer, pieces: list[str]) -> list[list[int]]:
    """Token ids of each piece, encoded in parallel inside the tokenizer's bounds."""
    if not isinstance(tokenizer, BoundedTokenizer):  # one qkv trained (train_bpe's pipeline)
        tokenizer = guard(tokenizer, "the trained tokenizer", pipeline=TRAINED_PIPELINE)
    return [encoding.ids for encoding in tokenizer.encode_batch(pieces, add_special_tokens=False)]
