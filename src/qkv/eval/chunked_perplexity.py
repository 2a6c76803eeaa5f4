"""Perplexity the way llama.cpp's `llama-perplexity` computes it, so the two numbers compare.

llama-perplexity (without --ppl-stride) cuts the tokenized text into non-overlapping chunks of
`context_length` tokens (a tail shorter than a chunk is dropped), puts the BOS token in place
of each chunk's first token when the tokenizer adds one (the file's add_bos), runs each chunk
from an empty cache and scores only its second half: the logits at positions
context_length // 2 .. context_length - 2 predict the tokens after them, so each chunk scores
context_length - context_length // 2 - 1 tokens, every one with at least half a chunk of
history. perplexity = exp(total negative log-likelihood / tokens scored), as in
`qkv.eval.perplexity`, whose sliding window scores every token instead.

Shape legend: N tokens of the text, T tokens of a chunk, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder
from qkv.eval.perplexity import Perplexity

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def scored_per_chunk(context_length: int) -> int:
    """Tokens llama-perplexity scores in each chunk of `context_length` tokens."""
    return context_length - context_length // 2 - 1


def check_chunk_length(context_length: int) -> None:
    """QkvError unless a chunk of `context_length` tokens scores at least one token."""
    if scored_per_chunk(context_length) < 1:
        raise QkvError(f"a chunk must be at least 3 tokens to score its second half, got {context_length}")


def chunk_count(n: int, context_length: int) -> int:
    """How many whole chunks of `context_length` tokens n tokens hold; QkvError when the
    chunk scores nothing or the text holds no whole chunk."""
    check_chunk_length(context_length)
    if n < context_length:
        raise QkvError(
            f"the text has {n} tokens, fewer than one chunk of {context_length}; give a longer text "
            "or a smaller --context-length"
        )
    return n // context_length


def chunked_perplexity(
    model: CausalDecoder,
    ids: Tensor,
    *,
    context_length: int,
    bos_token_id: int | None,
    progress: Callable[[int], None] | None = None,
) -> Perplexity:
    """llama-perplexity's perplexity of `model` on the token ids (N,) of the whole text (BOS
    first if the tokenizer adds one); `bos_token_id` replaces each chunk's first token (None:
    the tokenizer adds no BOS and the chunks are scored as they are). `progress(k)` after each
    chunk with the number of tokens it scored."""
    if ids.dim() != 1:
        raise QkvError(f"the token ids must be one sequence, got shape {tuple(ids.shape)}")
    chunks = chunk_count(ids.numel(), context_length)
    if context_length > model.context_length:
        raise QkvError(
            f"--context-length {context_length} exceeds the model's context length ({model.context_length})"
        )
    first = context_length // 2
    total, scored = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for index in range(chunks):
            chunk = ids[index * context_length : (index + 1) * context_length].clone()  # (T,)
            if bos_token_id is not None:
                chunk[0] = bos_token_id
            logits = model(chunk.unsqueeze(0))[0, first : context_length - 1].float()  # (T - first - 1, V)
            targets = chunk[first + 1 :]  # (T - first - 1,)
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            scored += targets.numel()
            if progress is not None:
                progress(targets.numel())
    nll = total / scored
    return Perplexity(perplexity=math.exp(nll), nll=nll, tokens=scored, windows=chunks)


def added_bos(tokenizer: Tokenizer) -> int | None:
    """The BOS id the tokenizer puts before every text (llama.cpp's add_bos), or None when it
    adds nothing; QkvError when it adds more than one token, which llama-perplexity refuses too."""
    added = tokenizer.encode("").ids
    if len(added) > 1:
        raise QkvError(
            f"the tokenizer adds {len(added)} special tokens to every text ({added}); the llama-cpp "
            "scheme needs at most a BOS before it (llama-perplexity refuses an added EOS)"
        )
    return added[0] if added else None


def llama_cpp_text(text: str) -> str:
    """The text llama-perplexity scores from a file: `-f` drops one final newline."""
    return text[:-1] if text.endswith("\n") else text
