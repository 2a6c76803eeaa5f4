"""Training data as the book builds it: a 90/10 character split, sliding token windows.

A window starting at token i is the input ids[i : i + L] and the target ids[i+1 : i+L+1]
(the next token at every position). Windows start every `stride` tokens; the book
trains with stride = L (no overlap). Each epoch shuffles the training windows with a
generator seeded by (seed, epoch), so the order is a function of the data position
alone and a resumed run sees exactly the batches it would have seen.

Distributed sharding keeps the global batch of a run equal whatever the number of
processes: global batch k is perm[k*G : (k+1)*G] with G = batch x world size, and rank r
takes the contiguous slice [r*batch : (r+1)*batch] of it.

The runs read the corpus as a stream (the whole-text reading it replaced is the reference it
is tested against, in tests/training/test_data.py): `qkv train --data`
takes corpora of several GB, and holding the text, then a Python list of its token ids
(about 9 bytes per character together), does not fit. The file is read in chunks three
times and never whole:

1. `scan_corpus`: the characters (after the universal-newline translation that reading a
   text file does), the fingerprint of the UTF-8 text and the checks of
   qkv.util.text_file.read_text_file, with the same messages;
2. the BPE tokenizer, when the run trains one, learns from the training split's first
   `MAX_BPE_CHARACTERS` characters (a tokenizer trainer holds what it counts; a sample
   bounds it, and for smaller files it is the whole split, as before);
3. `TokenFile.write`: each split tokenized in line-aligned pieces (a split of up to 1 Mi
   characters is one piece, as qkv.training.tokenizer.encode makes it, so small files give
   the same ids; longer ones in pieces of 64 Ki characters) a batch at a time,
   the ids appended to an unnamed temporary file in the output folder as uint16 (uint32
   for vocabularies over 65,536), with a progress bar.

The split is the book's: the first 90% of the characters train, the rest validate
(split_text on the whole text gives the same two texts).

`FileWindows` are sliding (input, target) windows over such a file: a batch reads its windows with pread, so the process holds only the batch. A memory map would do the same
work but its touched pages count in the resident set, which over an epoch of random
windows grows to the file's size.

Shape legend: N windows, B batch (per process), L window length (tokens).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.training.tokenizer import ENCODE_PIECE_CHARS, encode_pieces
from qkv.util.progress import progress_bar

TRAIN_RATIO = 0.90  # the book's split
WHEN_EMPTY = "is empty; give --data a file with some text"


def require_windows(windows: Any, split: str, tokens: int) -> None:
    """At least one window (`windows`: FileWindows, or anything with a length)."""
    if len(windows) == 0:
        raise QkvError(
            f"the {split} split has {tokens} tokens, fewer than one window of "
            f"{windows.length + 1}; use more text or a smaller --context-length"
        )


@dataclass(frozen=True)
class BatchSchedule:
    """Which training windows each process reads at every step."""

    num_windows: int
    batch_size: int  # per process
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch == 0:
            raise QkvError(
                f"the training split has {self.num_windows} windows, fewer than one global "
                f"batch of {self.global_batch}; lower --batch-size or --context-length or "
                "--stride, or use more text"
            )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.global_batch  # the book drops the last partial batch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of a 0-based global step."""
        return divmod(step, self.steps_per_epoch)

    def permutation(self, epoch: int) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=generator)  # (N,)

    def indices(self, step: int, rank: int, permutation: Tensor | None = None) -> Tensor:
        """Window indices that `rank` trains on at `step` (permutation: this epoch's)."""
        epoch, k = self.position(step)
        perm = self.permutation(epoch) if permutation is None else permutation
        start = k * self.global_batch + rank * self.batch_size
        return perm[start : start + self.batch_size]  # (B,)


# -- the corpus as a stream ------------------------------------------------------------

READ_BYTES = 1 << 22  # one read of the file
MAX_BPE_CHARACTERS = 64 << 20  # what a trained BPE learns from (about 64 MB of text)
BPE_PIECE_CHARS = 1 << 16  # qkv.training.tokenizer.train_bpe's pieces
STREAM_PIECE_CHARS = 1 << 16  # pieces of a split longer than ENCODE_PIECE_CHARS
BATCH_CHARACTERS = 1 << 19  # tokenized together, in parallel: ~300 bytes a token while encoding
ANNOUNCE_BYTES = 64 << 20  # a file this large takes a noticeable time to read


@dataclass(frozen=True)
class CorpusText:
    """A UTF-8 text file known by one pass: its length in characters and its fingerprint."""

    path: Path
    characters: int
    fingerprint: str  # as text_fingerprint of the whole text

    @property
    def train_characters(self) -> int:
        return int(TRAIN_RATIO * self.characters)  # the book's cut (split_text)

    def chunks(self, start: int = 0, stop: int | None = None) -> Iterator[str]:
        """The text's characters [start, stop) in chunks of at most a read's size."""
        stop = self.characters if stop is None else stop
        position = 0
        for chunk in _decoded_chunks(self.path):
            end = position + len(chunk)
            if end > start:
                yield chunk[max(start - position, 0) : stop - position]
            position = end
            if position >= stop:
                return

    def split(self, name: str) -> Iterator[str]:
        """The training or validation text, in chunks."""
        cut = self.train_characters
        return self.chunks(0, cut) if name == "training" else self.chunks(cut)

    def bpe_sample(self) -> Iterator[str]:
        """What a trained BPE learns from: the training split's first MAX_BPE_CHARACTERS
        characters, in train_bpe's pieces (the same pieces when the split is smaller)."""
        return _pieces_of(self.chunks(0, min(self.train_characters, MAX_BPE_CHARACTERS)), BPE_PIECE_CHARS)

    @property
    def sampled_for_bpe(self) -> bool:
        return self.train_characters > MAX_BPE_CHARACTERS


def _decoded_chunks(path: Path) -> Iterator[str]:
    """The file's text as open(path, encoding="utf-8").read() gives it, chunk by chunk; a
    byte that is not UTF-8 is a QkvError naming its offset in the file."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    decoder = io.IncrementalNewlineDecoder(utf8, translate=True)
    offset = 0  # bytes fed to the decoder so far
    try:
        with path.open("rb") as handle:
            while True:
                data = handle.read(READ_BYTES)
                pending = len(utf8.getstate()[0])
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as error:
                    raise QkvError(f"data file {path} is not UTF-8 text (byte {offset - pending + error.start}); "
                                   "convert it first") from None
                offset += len(data)
                if text:
                    yield text
                if not data:
                    return
    except OSError as error:
        raise QkvError(f"cannot read data file {path}: {error.strerror}") from None


def scan_corpus(path: str | Path, *, when_empty: str) -> CorpusText:
    """One pass over `path`: a missing, unreadable, non-UTF-8 or blank file is a QkvError
    (qkv.util.text_file.read_text_file's messages); else its length and fingerprint."""
    p = Path(path)
    if not p.exists():
        raise QkvError(f"data file {p} does not exist; give --data a UTF-8 text file")
    if not p.is_file():
        raise QkvError(f"data path {p} is not a file; give --data a UTF-8 text file")
    digest, characters, blank = hashlib.sha256(), 0, True
    for chunk in _decoded_chunks(p):
        digest.update(chunk.encode("utf-8"))
        characters += len(chunk)
        blank = blank and not chunk.strip()
    if blank:
        raise QkvError(f"data file {p} {when_empty}")
    return CorpusText(p, characters, digest.hexdigest()[:16])


def announce_corpus(path: str | Path) -> None:
    """One line on stderr before a large file's passes, which take seconds per GB."""
    with contextlib.suppress(OSError):
        size = Path(path).stat().st_size
        if size >= ANNOUNCE_BYTES:
            print(f"reading {path} ({size / 1e9:.2f} GB): a pass to check and count it, then tokenizing it "
                  "into a temporary file beside the run", file=sys.stderr, flush=True)


def _pieces_of(chunks: Iterable[str], size: int) -> Iterator[str]:
    """The text of `chunks` re-cut into pieces of exactly `size` characters (the last shorter)."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        while len(buffer) >= size:
            yield buffer[:size]
            buffer = buffer[size:]
    if buffer:
        yield buffer


def encode_pieces_of(chunks: Iterable[str], piece_chars: int) -> Iterator[str]:
    """Line-aligned pieces of a streamed text, cut as qkv.training.tokenizer.encode cuts: a
    piece ends at the first newline at or after `piece_chars` characters (a text no longer
    than that is one piece); one with no newline by 4 x `piece_chars` is cut there."""
    longest = 4 * piece_chars
    buffer, whole = "", True
    for chunk in chunks:
        buffer += chunk
        while len(buffer) > piece_chars:
            end = buffer.find("\n", piece_chars, longest)
            if end < 0:
                if len(buffer) < longest:
                    break  # the newline may be in the next chunk
                end = longest - 1
            yield buffer[: end + 1]
            buffer, whole = buffer[end + 1 :], False
    if buffer or whole:
        yield buffer


class TokenFile:
    """Token ids in an unnamed temporary file (gone when it is closed or the process ends)."""

    def __init__(self, handle: Any, dtype: np.dtype, count: int) -> None:
        self.handle, self.dtype, self.count = handle, dtype, count

    @classmethod
    def write(cls, tokenizer: Any, chunks: Iterable[str], characters: int, folder: Path | None, *,
              bar: Any = None) -> TokenFile:
        """Tokenize the streamed text of `characters` characters into a new file in `folder`
        (None: the temporary folder); `bar` counts characters. A text of up to
        ENCODE_PIECE_CHARS characters is one piece, as encode makes it (the same ids); a
        longer one is cut in smaller pieces, which bound what the tokenizer holds."""
        dtype = np.dtype(np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.uint32)
        handle = tempfile.TemporaryFile(dir=folder, prefix=".qkv-tokens-")
        piece_chars = ENCODE_PIECE_CHARS if characters <= ENCODE_PIECE_CHARS else STREAM_PIECE_CHARS
        count, batch, size = 0, [], 0
        for piece in encode_pieces_of(chunks, piece_chars):
            batch.append(piece)
            size += len(piece)
            if size >= BATCH_CHARACTERS:
                count += cls._append(handle, tokenizer, batch, dtype, bar)
                batch, size = [], 0
        if batch:
            count += cls._append(handle, tokenizer, batch, dtype, bar)
        handle.flush()
        return cls(handle, dtype, count)

    @staticmethod
    def _append(handle: Any, tokenizer: Any, pieces: list[str], dtype: np.dtype, bar: Any) -> int:
        written = 0
        for ids in encode_pieces(tokenizer, pieces):
            array = np.asarray(ids, dtype=dtype)
            handle.write(array.tobytes())
            written += array.size
        if bar is not None:
            bar.update(sum(len(p) for p in pieces))
        return written

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, count: int) -> np.ndarray:
        """ids[start : start + count] as int64 (one pread)."""
        data = os.pread(self.handle.fileno(), count * self.dtype.itemsize, start * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype).astype(np.int64)

    def close(self) -> None:
        self.handle.close()


class FileWindows:
    """TokenWindows over a TokenFile: the same windows, read per batch."""

    def __init__(self, tokens: TokenFile, length: int, stride: int) -> None:
        self.tokens, self.length, self.stride = tokens, length, stride
        self.count = 0 if len(tokens) < length + 1 else (len(tokens) - length - 1) // stride + 1

    def __len__(self) -> int:
        return self.count

    def row(self, index: int) -> Tensor:
        """Window `index`: ids[index*stride : index*stride + L + 1], (L + 1,)."""
        return torch.from_numpy(self.tokens.read(int(index) * self.stride, self.length + 1))

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        rows = torch.stack([self.row(i) for i in index.tolist()])  # (B, L + 1)
        return rows[:, :-1], rows[:, 1:]  # inputs (B, L), targets (B, L)


def tokenize_corpus(corpus: CorpusText, tokenizer: Any, folder: Path | None, *, progress: bool) -> tuple[TokenFile, TokenFile]:
    """The training and validation splits' ids, each in its own TokenFile in `folder`."""
    bar = progress_bar(total=corpus.characters, desc="tokenizing", unit="char", enabled=progress, unit_scale=True)
    try:
        cut = corpus.train_characters
        return (TokenFile.write(tokenizer, corpus.split("training"), cut, folder, bar=bar),
                TokenFile.write(tokenizer, corpus.split("validation"), corpus.characters - cut, folder, bar=bar))
    finally:
        bar.close()
