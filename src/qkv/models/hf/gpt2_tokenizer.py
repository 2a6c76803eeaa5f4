"""GPT-2's tokenizer, offline: tiktoken's `gpt2` encoding as a `tokenizers.Tokenizer`.

The book encodes text with `tiktoken.get_encoding("gpt2")`, which downloads GPT-2's
vocabulary on first use. The same ranks ship inside the `openai-whisper` distribution
(MIT; `whisper/assets/gpt2.tiktoken`, the byte strings of GPT-2's 50,256 BPE tokens in
rank order), so qkv reads them from there, without importing whisper (its own
dependencies are not needed: `pip install --no-deps openai-whisper`).

A tiktoken rank table becomes GPT-2's byte-level BPE: the first 256 ranks are the single
bytes, and every later rank r is the merge of the two pieces that byte-pair merging,
allowed only ranks below r, leaves of that token; merges in rank order are GPT-2's
vocab.bpe. The pre-tokenizer is GPT-2's regular expression (tokenizers' ByteLevel), and
<|endoftext|> is the special token 50256, recognised wherever it appears in the text (as
tiktoken's `allowed_special={"<|endoftext|>"}`, the book's GPTDatasetV1 setting).
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from qkv.errors import QkvError
from qkv.models.hf.packaged import packaged_file

DISTRIBUTION = "openai-whisper"
RANKS_FILE = "gpt2.tiktoken"
END_OF_TEXT = "<|endoftext|>"
END_OF_TEXT_ID = 50256
VOCAB_SIZE = 50257
MAX_RANKS_BYTES = 8 * 2**20  # the file is 0.8 MB


def ranks_path() -> Path:
    """GPT-2's rank file inside the installed openai-whisper distribution."""
    return packaged_file(DISTRIBUTION, RANKS_FILE, f"GPT-2's tokenizer (the {RANKS_FILE} file)")


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken file (one 'base64-token rank' per line) -> {token bytes: rank}."""
    if path.stat().st_size > MAX_RANKS_BYTES:
        raise QkvError(f"{path} is larger than a GPT-2 rank file can be ({MAX_RANKS_BYTES:,} bytes)")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise QkvError(f"{path} line {number} is not 'base64-token rank'; reinstall {DISTRIBUTION}") from None
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) != END_OF_TEXT_ID:
        raise QkvError(f"{path} does not hold GPT-2's {END_OF_TEXT_ID:,} ranks 0..{END_OF_TEXT_ID - 1}")
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte: printable Latin-1 bytes stand for
    themselves, the others are moved to code points from 256 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pieces_below(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair merging of `token` with only the ranks below `max_rank` (lowest rank first)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token, in rank order (GPT-2's vocab.bpe)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _pieces_below(ranks, token, rank)
        if len(parts) != 2:
            raise QkvError(f"rank {rank} ({token[:20]!r}) is not the merge of two earlier tokens")
        merges.append((parts[0], parts[1]))
    return merges


@functools.lru_cache(maxsize=2)
def _tokenizer_json(path: Path) -> str:
    ranks = read_ranks(path)
    show = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(show[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    if tokenizer.token_to_id(END_OF_TEXT) != END_OF_TEXT_ID:
        raise QkvError(f"{END_OF_TEXT} did not become token {END_OF_TEXT_ID}")
    return tokenizer.to_str()


def gpt2_tokenizer(path: Path | None = None) -> Tokenizer:
    """A fresh `tokenizers.Tokenizer` that encodes exactly as tiktoken's `gpt2` encoding
    (built once per process from the packaged ranks, about a second; then copied)."""
    return Tokenizer.from_str(_tokenizer_json(ranks_path() if path is None else path))


__all__ = ["END_OF_TEXT", "END_OF_TEXT_ID", "VOCAB_SIZE", "gpt2_tokenizer", "ranks_path", "read_ranks"]
