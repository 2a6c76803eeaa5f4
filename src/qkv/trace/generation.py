"""Watch the KV cache while a decoder generates: each new token's query, scored against
every cached key.

Greedy decoding, one token per step, through the model's own KV cache
(`setup_cache` / `remove_cache`, the interface qkv's decoders share). Every step is a
`trace` of one forward call with one new token, so each recorded step is checked against
the real output like any other trace.

Shape legend: T prompt tokens, S cached keys after a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.trace.recorder import LayerTrace, trace


@dataclass
class CacheStep:
    """One decode step: the new token, what the cache held, how the query spread its weight."""

    token_id: int  # the token fed in at this step (whose query is scored)
    position: int  # its absolute position
    cache_length: int  # keys cached before the step
    layer: LayerTrace  # the recorded step (one query, S = cache_length + 1 keys)
    next_token_id: int  # the greedy choice that follows


@torch.no_grad()
def trace_generation(
    model: nn.Module, input_ids: Tensor, steps: int, *, layer: int, head: int
) -> list[CacheStep]:
    """Prefill the prompt, then decode `steps` tokens greedily, tracing each decode step."""
    if steps < 1:
        raise QkvError(f"--generate needs at least 1 token, got {steps}")
    for needed in ("setup_cache", "remove_cache"):
        if not hasattr(model, needed):
            raise QkvError(
                f"{type(model).__name__} has no KV cache to watch; --generate needs a decoder"
            )
    total = input_ids.shape[1] + steps
    if total > model.context_length:
        raise QkvError(
            f"{total} tokens exceed the model's context length ({model.context_length}); "
            "ask for fewer with --generate"
        )
    model.setup_cache(1, total)
    try:
        logits = model(input_ids)  # (1, T, V): the prompt fills the cache
        token = int(logits[0, -1].argmax())
        result = []
        for _ in range(steps):
            position = model.cache_length()
            recorded = trace(model, torch.tensor([[token]]), layer=layer, head=head)
            logits = recorded.output
            next_token = int(logits[0, -1].argmax())
            result.append(CacheStep(token_id=token, position=position, cache_length=position,
                                    layer=recorded.layers[0], next_token_id=next_token))
            token = next_token
        return result
    finally:
        model.remove_cache()
