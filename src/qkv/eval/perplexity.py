"""Perplexity of a decoder on a text, with a sliding window (Hugging Face's strided method).

A text longer than the window is scored in windows of `context_length` tokens that start
`stride` tokens apart. Each window is one forward pass, but only the tokens it adds beyond
the previous window are scored, so every token after the first is scored exactly once; after
the first window each scored token sees at least context_length - stride tokens of history
(and at most context_length - 1; inside the first window, whatever precedes it). perplexity = exp(total negative
log-likelihood / tokens scored). A stride close to context_length is fast (few passes, less
context per token); a smaller one costs more passes and gives each token more context. The
stride stays below context_length: windows overlap by at least one token, so the first new
token of every window is predicted from something.

With a `ContextParallel` every window is sharded over its processes (ring attention): each
rank scores the tokens whose predictions fall in its shard, and the sums are added over
the ring's group, so every rank returns the single-process result.

Shape legend: N tokens of the text, T tokens of a window, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.context_parallel import ContextParallel, sharded_forward
from qkv.models.decoder import CausalDecoder


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens scored (every token but the first)
    windows: int  # forward passes


def windows(n: int, context_length: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n tokens."""
    if context_length < 2:
        raise QkvError(f"the context length must be at least 2 tokens, got {context_length}")
    if not 1 <= stride < context_length:
        # Windows must overlap by a token, or the first new token of each has no predecessor.
        raise QkvError(
            f"the stride must be between 1 and the context length - 1 ({context_length - 1}), got {stride}"
        )
    previous_end = 0
    for begin in range(0, n, stride):
        end = min(begin + context_length, n)
        yield begin, end, max(previous_end, begin + 1)
        previous_end = end
        if end == n:
            return


def perplexity(
    model: CausalDecoder,
    ids: Tensor,
    *,
    context_length: int,
    stride: int,
    progress: Callable[[int], None] | None = None,
    context_parallel: ContextParallel | None = None,
) -> Perplexity:
    """Sliding-window perplexity of `model` on the token ids (N,); `progress(k)` after each
    window with the number of tokens it scored. With `context_parallel`, call it on every
    rank of the ring with the same ids."""
    if ids.dim() != 1 or ids.numel() < 2:
        raise QkvError(f"perplexity needs at least 2 tokens of text, got {ids.numel()}")
    if context_length > model.context_length:
        raise QkvError(
            f"--context-length {context_length} exceeds the model's context length ({model.context_length})"
        )
    total, scored, passes = 0.0, 0, 0
    model.eval()
    with torch.inference_mode():
        for begin, end, first in windows(ids.numel(), context_length, stride):
            window = ids[begin:end].unsqueeze(0)  # (1, T)
            if context_parallel is None:
                logits = model(window)[0, first - begin - 1 : end - begin - 1].float()  # (scored, V)
                targets = ids[first:end]  # (scored,)
                total += F.cross_entropy(logits, targets, reduction="sum").item()
            else:
                total += _sharded_nll(model, window, first - begin, context_parallel)
            scored += end - first
            passes += 1
            if progress is not None:
                progress(end - first)
    nll = total / scored
    return Perplexity(perplexity=math.exp(nll), nll=nll, tokens=scored, windows=passes)


def _sharded_nll(model: CausalDecoder, window: Tensor, first: int, cp: ContextParallel) -> float:
    """Summed NLL of window tokens first.. (positions within the window), the window (1, T)
    sharded over the ring: each rank scores the predictions its rows make."""
    part = sharded_forward(model, window, cp)
    rows = part.positions  # (T_rank,): the position whose next token each row predicts
    keep = (rows >= first - 1) & (rows < window.shape[1] - 1)
    logits = part.logits[0, keep].float()  # (scored here, V)
    targets = window[0, rows[keep] + 1]  # (scored here,)
    nll = F.cross_entropy(logits, targets, reduction="sum").double().reshape(1)
    if cp.group is not None:
        dist.all_reduce(nll, group=cp.group)
    return nll.item()
