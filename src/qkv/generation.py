"""Text generation from small pure steps: prefill, decode_one, sample.

    generate(model, input_ids (B, T), max_new_tokens, *, ...) -> ids (B, T + new)
    stream(model, input_ids (B, T), max_new_tokens, *, ...) -> iterator of (B,) new tokens

With the KV cache (the default) the prompt is run once (`prefill`), then each new token
costs one row (`decode_one`); without it every step re-runs the whole sequence, which is
the reference the cache must reproduce. Every model step runs under
torch.inference_mode(); sampling draws from its own torch.Generator, never the global RNG.

Batches of prompts of different lengths are left-padded, with `attention_mask` (B, T)
1 for real tokens and 0 for padding: each row then gets per-row positions (its first real
token is position 0) and a key padding mask, so it produces the same tokens as alone.
Without padding the decode step passes no mask at all and allocates no new buffers for
ids or masks: one query attending to every cached key needs no causal mask.

Shape legend: B batch, T prompt tokens, N new tokens, S keys (prompt + new), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder


def sample(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens (B,) from last-position logits (B, V). Temperature 0 is greedy (argmax).

    top_k keeps the k most likely tokens; top_p keeps the smallest set of most likely
    tokens whose probabilities add up to at least p (the most likely one always stays).
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        sorted_scores = sorted_scores.masked_fill(mass_before >= top_p, -torch.inf)
        scores = torch.full_like(scores, -torch.inf).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


def prefill(
    model: CausalDecoder, input_ids: Tensor, *, positions: Tensor | None = None, mask: Tensor | None = None
) -> Tensor:
    """Run the prompt (B, T) through the model (filling its cache); last logits (B, V)."""
    with torch.inference_mode():
        return model(input_ids, positions=positions, mask=mask)[:, -1]


def decode_one(
    model: CausalDecoder, token: Tensor, *, positions: Tensor | None = None, mask: Tensor | None = None
) -> Tensor:
    """One cached step: the newest token (B, 1) -> its logits (B, V)."""
    with torch.inference_mode():
        return model(token, positions=positions, mask=mask)[:, -1]


def _validate(
    model: CausalDecoder, input_ids: Tensor, max_new_tokens: int, temperature: float,
    top_k: int | None, top_p: float | None, attention_mask: Tensor | None,
) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype not in (torch.int64, torch.int32):
        raise QkvError(
            f"input_ids must be a non-empty (batch, tokens) integer tensor, got {input_ids.dtype} "
            f"of shape {tuple(input_ids.shape)}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise QkvError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not temperature >= 0.0:
        raise QkvError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise QkvError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise QkvError(f"top_p must be in (0, 1], got {top_p}")
    total, context = input_ids.shape[1] + max_new_tokens, model.context_length
    if input_ids.shape[1] > context:
        raise QkvError(
            f"the prompt has {input_ids.shape[1]} tokens, more than the model's context length ({context}); "
            "shorten it"
        )
    if total > context:
        raise QkvError(
            f"{input_ids.shape[1]} prompt tokens + {max_new_tokens} new tokens exceed the model's "
            f"context length ({context}); ask for at most {context - input_ids.shape[1]} new tokens"
        )
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise QkvError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        real = attention_mask.bool()
        if not bool(real[:, -1].all()) or bool((real[:, 1:] < real[:, :-1]).any()):
            raise QkvError("attention_mask must describe left padding: zeros first, then ones, in every row")


def _eos_set(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def stream(
    model: CausalDecoder,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
) -> Iterator[Tensor]:
    """Yield the new tokens (B,) one step at a time; see `generate` for the arguments.

    Rows that have produced an end token keep yielding it. The model is put in eval mode
    and given a fresh KV cache for the duration, then restored (cache removed). Arguments
    are checked at the call, before the first token is asked for.
    """
    _validate(model, input_ids, max_new_tokens, temperature, top_k, top_p, attention_mask)
    return _steps(
        model, input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, use_cache=use_cache, eos=_eos_set(eos_token_id), attention_mask=attention_mask,
    )


def _steps(
    model: CausalDecoder,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    use_cache: bool,
    eos: tuple[int, ...],
    attention_mask: Tensor | None,
) -> Iterator[Tensor]:
    b, t = input_ids.shape
    total, device = t + max_new_tokens, input_ids.device
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    tokens = torch.empty(b, total, dtype=torch.long, device=device)  # (B, S): prompt, then new tokens
    tokens[:, :t] = input_ids
    keys: Tensor | None = None  # (B, S) True = real token, only with padding
    positions: Tensor | None = None  # (B, S) per-row positions, only with padding
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        keys = torch.ones(b, total, dtype=torch.bool, device=device)
        keys[:, :t] = attention_mask.bool()
        positions = (keys.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, S)

    def rows(end: int, start: int = 0) -> dict[str, Tensor | None]:
        return {
            "positions": None if positions is None else positions[:, start:end],
            "mask": None if keys is None else keys[:, :end],
        }

    was_training = model.training
    model.eval()
    if use_cache and max_new_tokens > 0:
        model.setup_cache(b, total, device=device)
    try:
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            end = t + i
            if not use_cache:
                logits = prefill(model, tokens[:, :end], **rows(end))
            elif i == 0:
                logits = prefill(model, tokens[:, :t], **rows(t))
            else:
                logits = decode_one(model, tokens[:, end - 1 : end], **rows(end, end - 1))
            new = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)  # (B,)
            if eos:
                new = torch.where(finished, eos_ids[0], new)
                finished |= torch.isin(new, eos_ids)
            tokens[:, end] = new
            yield new
            if eos and bool(finished.all()):
                return
    finally:
        model.remove_cache()
        model.train(was_training)


def generate(
    model: CausalDecoder,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """The prompt ids (B, T) followed by up to max_new_tokens new ones: (B, T + N).

    temperature 0 is greedy; otherwise tokens are drawn (after top_k / top_p filtering)
    from a generator seeded with `seed`. Generation stops early once every row has
    produced one of `eos_token_id`; finished rows are filled with the (first) end token.
    `attention_mask` (B, T) marks real tokens (1) and left padding (0).
    """
    new = list(
        stream(
            model, input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, use_cache=use_cache, eos_token_id=eos_token_id, attention_mask=attention_mask,
        )
    )
    if not new:
        return input_ids.clone()
    return torch.cat([input_ids.long(), torch.stack(new, dim=1)], dim=1)  # (B, T + N)
