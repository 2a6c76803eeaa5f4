"""Generating past the model's context length: crop the window, or slide with a sink cache.

A request whose prompt and new tokens do not fit the context length goes on instead of
failing, in one of two ways, chosen from the model and said in one line:

- learned positions (GPT-2, the book's GPT): the book's `generate_text_simple` way. Once
  the sequence fills the context, every further token is predicted from the last
  `context_length` tokens, re-run from position 0 (a position table cannot slide, so
  nothing cached can be reused); a prompt longer than the context is cropped the same way.
- RoPE (Llama, Qwen) with the default full cache: a sink cache (StreamingLLM: the first 4
  tokens and as many of the newest as fit), which re-numbers the positions it rotates by,
  so decoding stays one cached step a token at any length. With another cache kind, or
  without a cache, the window is cropped as above.

Shape legend: B batch, T tokens so far, W window (at most the context length), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.kv_cache import CacheKind, StaticKVCache
from qkv.attention.sink_cache import SinkKVCache
from qkv.generation.sampling import Sampling, choose
from qkv.models.decoder import CausalDecoder

SINKS = 4  # StreamingLLM's sink tokens


@dataclass(frozen=True)
class ContextPlan:
    kind: CacheKind  # the cache kind to decode with
    crop: bool  # True: past the context, each step re-runs the last context_length tokens
    note: str | None  # the one line that says what happens past the context (None: it all fits)


def plan_past_context(model: CausalDecoder, prompt_tokens: int, max_new_tokens: int, kind: CacheKind,
                      *, use_cache: bool) -> ContextPlan:
    """How a request of `prompt_tokens` + `max_new_tokens` runs (see the module docstring)."""
    context = model.context_length
    needed = prompt_tokens + max_new_tokens - 1  # the last new token is never fed back
    if needed <= context or (use_cache and model.streams_past_context(kind)):
        return ContextPlan(kind, False, None)
    total = prompt_tokens + max_new_tokens
    if use_cache and kind is StaticKVCache and model.rotary_embedding() is not None:
        chunk = max(1, min(256, context // 4))  # prompt tokens fed per call
        window = context - SINKS - chunk
        if window >= 1:
            return ContextPlan(
                SinkKVCache.kind(sinks=SINKS, window=window, prefill_chunk=chunk), False,
                f"{total} tokens pass the context length ({context}): generating on with a sink cache "
                f"(the first {SINKS} tokens and the newest {window}; StreamingLLM)",
            )
    return ContextPlan(
        kind, True,
        f"{total} tokens pass the context length ({context}): past it, each token is predicted from the "
        f"last {context} tokens, re-run without a cache (the book's generate_text_simple crops its window so)",
    )


def cropped_steps(model: CausalDecoder, tokens: Tensor, ends: Tensor, steps: int, sampling: Sampling,
                  stop: tuple[int, ...], generator: torch.Generator | None, finished: Tensor) -> Iterator[Tensor]:
    """`steps` new tokens (B,), each from the row's last context_length tokens.

    tokens (B, T + steps) holds each row's tokens first (row r: tokens[r, :ends[r]]), room
    after; `ends` (B,) and `finished` (B,) are updated in place."""
    context = model.context_length
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    stop_ids = torch.tensor(list(stop), dtype=torch.long, device=tokens.device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(steps):
            width = min(context, int(ends.max()))
            starts = (ends - width).clamp(min=0)  # (B,) rows shorter than the window start at 0
            columns = starts[:, None] + torch.arange(width, device=tokens.device)[None]  # (B, W)
            window = tokens.gather(1, columns)  # (B, W); a shorter row's tail is never seen (causal)
            with torch.inference_mode():
                logits = model(window)[rows, ends - starts - 1]  # (B, V)
            new = choose(logits, sampling, generator)
            if stop:
                new = torch.where(finished, stop_ids[0], new)
                finished |= torch.isin(new, stop_ids)
            tokens[rows, ends] = new
            ends += 1
            yield new
            if stop and bool(finished.all()):
                return
    finally:
        model.train(was_training)


__all__ = ["ContextPlan", "SINKS", "cropped_steps", "plan_past_context"]
