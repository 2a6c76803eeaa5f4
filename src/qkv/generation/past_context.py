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

from dataclasses import dataclass


from qkv.attention.caches.kv_cache import CacheKind, StaticKVCache
from qkv.attention.caches.sink_cache import SinkKVCache
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


__all__ = ["ContextPlan", "SINKS", "plan_past_context"]
