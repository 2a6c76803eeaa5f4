"""Watch the KV cache while a decoder generates: each new token's query, scored against
every cached key.

Greedy decoding, one token per step, through the decode loop every command uses
(`qkv.generation`: a `DecodeSession` and `continue_from`), with the selected layer
`recording` every decode step, so each recorded step is checked against the real output
like any other trace.

Shape legend: T prompt tokens, S cached keys after a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.generation import continue_from
from qkv.runtime import DecodeSession
from qkv.models.decoder import CausalDecoder
from qkv.trace.record.recorder import LayerTrace, recording


@dataclass
class CacheStep:
    """One decode step: the new token, what the cache held, how the query spread its weight."""

    token_id: int  # the token fed in at this step (whose query is scored)
    position: int  # its absolute position
    cache_length: int  # keys cached before the step
    layer: LayerTrace  # the recorded step (one query, S = cache_length + 1 keys)
    next_token_id: int  # the greedy choice that follows


def trace_generation(
    model: nn.Module, input_ids: Tensor, steps: int, *, layer: int, head: int
) -> list[CacheStep]:
    """Prefill the prompt, then decode `steps` tokens greedily, tracing each decode step."""
    if steps < 1:
        raise QkvError(f"--generate needs at least 1 token, got {steps}")
    if not isinstance(model, CausalDecoder):
        raise QkvError(f"{type(model).__name__} has no KV cache to watch; --generate needs a decoder")
    t = input_ids.shape[1]
    if t + steps > model.context_length:
        raise QkvError(
            f"{t + steps} tokens exceed the model's context length ({model.context_length}); "
            "ask for fewer with --generate"
        )
    with DecodeSession(model, capacity=t + steps, step="modules") as session:  # hooks see every step
        logits = session.prefill(input_ids)
        with recording(model, layer=layer, head=head) as records:
            # steps + 1 choices: each of the first `steps` is decoded (and traced) to make the next
            chosen = [int(new[0]) for new in continue_from(session, logits, steps + 1)]
    calls = records[layer]
    return [
        CacheStep(token_id=chosen[i], position=t + i, cache_length=t + i, layer=calls[i],
                  next_token_id=chosen[i + 1])
        for i in range(steps)
    ]
