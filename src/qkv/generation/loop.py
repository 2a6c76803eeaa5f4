"""The decode loop every command shares: prefill, decode steps, sampling, stopping, streaming.

    stream(model, input_ids (B, T), max_new_tokens, *, ...) -> iterator of (B,) new tokens
    generate(model, input_ids (B, T), max_new_tokens, *, ...) -> ids (B, T + N)
    continue_from(session, logits (B, V), max_new_tokens, *, sampling, stop) -> iterator of (B,)

`continue_from` is the loop itself (sample, stop, decode the choice, repeat) over an open
`DecodeSession`; `stream` opens a session for one batch of prompts and runs it, and `qkv
chat` runs it turn after turn on one long-lived session.

Batches of prompts of different lengths arrive left-padded, with `attention_mask` (B, T)
1 for real tokens and 0 for padding (transformers' convention). The loop moves each row's
padding to its end: every row then starts at position 0 and the cache's position mask
keeps each row to its own tokens, so each row produces the same tokens as alone, with no
padding mask at all.

Without the cache (`use_cache=False`) every step re-runs the whole sequence: the
reference the cache must reproduce.

Shape legend: B batch, T prompt tokens, N new tokens, V vocabulary.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.generation.constraints import Constraint
from qkv.generation.sampling import Sampling, choose
from qkv.attention.kv_cache import CacheKind, StaticKVCache
from qkv.generation.past_context import cropped_steps, plan_past_context
from qkv.runtime.session import DecodeSession
from qkv.models.decoder import CausalDecoder


def check_request(model: CausalDecoder, input_ids: Tensor, max_new_tokens: int,
                  attention_mask: Tensor | None = None, kind: CacheKind = StaticKVCache) -> None:
    """What `stream` checks before anything runs: the ids, the token count, the padding
    mask (`kind` is the cache kind the request asks for). Commands call it before preparing
    (compiling) a model."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype not in (torch.int64, torch.int32):
        raise QkvError(
            f"input_ids must be a non-empty (batch, tokens) integer tensor, got {input_ids.dtype} "
            f"of shape {tuple(input_ids.shape)}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise QkvError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    # Past the context length generation goes on (qkv.generation.past_context), so the
    # lengths are not limited here.
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise QkvError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        real = attention_mask.bool()
        if not bool(real[:, -1].all()) or bool((real[:, 1:] < real[:, :-1]).any()):
            raise QkvError("attention_mask must describe left padding: zeros first, then ones, in every row")


def stop_tokens(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def _hold_finished(new: Tensor, finished: Tensor, stop_ids: Tensor) -> Tensor:
    """Rows that have ended keep yielding the first stop token; marks rows that end now
    (`finished` is updated in place). new, finished: (B,)."""
    new = torch.where(finished, stop_ids[0], new)
    finished |= torch.isin(new, stop_ids)
    return new


def _choose(logits: Tensor, sampling: Sampling, generator: torch.Generator | None,
            constraint: Constraint | None, stop: Sequence[int]) -> Tensor:
    """The next tokens (B,); with a constraint (B = 1), only among those its grammar allows,
    and the grammar advanced by the choice (an end token ends it, it is not fed)."""
    if constraint is None:
        return choose(logits, sampling, generator)
    new = choose(constraint.mask(logits), sampling, generator)  # (1,)
    if int(new[0]) not in stop:
        constraint.accept(int(new[0]))
    return new


def continue_from(
    session: DecodeSession,
    logits: Tensor,
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    stop: Sequence[int] = (),
    generator: torch.Generator | None = None,
    constraint: Constraint | None = None,
) -> Iterator[Tensor]:
    """From the logits (B, V) of each row's last token, yield up to `max_new_tokens` new
    tokens (B,), decoding each one into the session's cache before asking for the next.

    A row that produces a `stop` token keeps yielding it; the loop ends when every row has
    (the stop token itself is yielded and is in the cache only if another step follows).
    A `constraint` (one row) masks each step's logits by its grammar, and the loop ends when
    the grammar is complete (qkv.generation.constraints).
    """
    if generator is None and not sampling.greedy:
        generator = sampling.generator(logits.device)
    stop_ids = torch.tensor(list(stop), dtype=torch.long, device=logits.device)
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for step in range(max_new_tokens):
        new = _choose(logits, sampling, generator, constraint, stop)  # (B,)
        if stop:
            new = _hold_finished(new, finished, stop_ids)
        yield new
        if (stop and bool(finished.all())) or step + 1 == max_new_tokens or (
                constraint is not None and constraint.finished):
            return
        logits = session.decode(new)  # (B, V)


def _right_aligned(input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, list[int]]:
    """Left-padded rows -> the same tokens first, padding last; and each row's length."""
    if attention_mask is None:
        return input_ids.long(), [input_ids.shape[1]] * input_ids.shape[0]
    real = attention_mask.bool()
    lengths = real.sum(dim=1).tolist()
    pad = input_ids.shape[1] - real.sum(dim=1)  # (B,)
    columns = (torch.arange(input_ids.shape[1], device=input_ids.device)[None] + pad[:, None]) % input_ids.shape[1]
    return input_ids.long().gather(1, columns), lengths  # (B, T)


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
    kv_cache: CacheKind = StaticKVCache,
    on_past_context: Callable[[str], object] | None = None,
    constraint: Constraint | None = None,
) -> Iterator[Tensor]:
    """Yield the new tokens (B,) one step at a time; see `generate` for the arguments
    (and `continue_from` for `constraint`, which takes one row).

    Arguments are checked at the call, before the first token is asked for. The model is
    put in eval mode and given caches for the duration (a `DecodeSession`), then restored.
    """
    check_request(model, input_ids, max_new_tokens, attention_mask, kv_cache)
    if constraint is not None and input_ids.shape[0] != 1:
        raise QkvError(f"a grammar constrains one row; got {input_ids.shape[0]} prompts")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    ids, lengths = _right_aligned(input_ids.to(next(model.parameters()).device), attention_mask)
    if max_new_tokens == 0:
        return iter(())
    plan = plan_past_context(model, max(lengths), max_new_tokens, kv_cache, use_cache=use_cache)
    if plan.note is not None:
        if on_past_context is None:
            warnings.warn(plan.note, stacklevel=2)
        else:
            on_past_context(plan.note)
    stop = stop_tokens(eos_token_id)
    if plan.crop and constraint is not None:
        raise QkvError(f"a constrained reply (--json-schema) must fit the context of {model.context_length} tokens: "
                       "ask for fewer new tokens or a shorter prompt")
    if plan.crop:
        if constraint is not None:
            raise QkvError("a grammar-constrained generation must fit the model's context; ask for fewer tokens")
        return _cropped(model, ids, lengths, max_new_tokens, sampling, stop, plan.kind, use_cache)
    if not use_cache:
        return _uncached(model, ids, lengths, max_new_tokens, sampling, stop, constraint=constraint)
    return _cached(model, ids, lengths, max_new_tokens, sampling, stop, plan.kind, constraint=constraint)


def _cached(model: CausalDecoder, ids: Tensor, lengths: list[int], max_new_tokens: int,
            sampling: Sampling, stop: tuple[int, ...], kind: CacheKind = StaticKVCache,
            generator: torch.Generator | None = None, constraint: Constraint | None = None) -> Iterator[Tensor]:
    capacity = min(ids.shape[1] + max_new_tokens, model.context_length)  # a sink cache may go past it
    with DecodeSession(model, batch_size=ids.shape[0], capacity=capacity, kind=kind) as session:
        logits = session.prefill(ids, lengths=lengths)
        yield from continue_from(session, logits, max_new_tokens, sampling=sampling, stop=stop, generator=generator,
                                 constraint=constraint)


def _cropped(model: CausalDecoder, ids: Tensor, lengths: list[int], max_new_tokens: int,
             sampling: Sampling, stop: tuple[int, ...], kind: CacheKind, use_cache: bool) -> Iterator[Tensor]:
    """As much as fits the context the usual way, then each step from the last
    context_length tokens (qkv.generation.past_context)."""
    context, longest = model.context_length, max(lengths)
    fitting = min(max_new_tokens, context - longest + 1) if longest <= context else 0
    b = ids.shape[0]
    tokens = torch.zeros(b, ids.shape[1] + max_new_tokens, dtype=torch.long, device=ids.device)  # (B, T + N)
    tokens[:, : ids.shape[1]] = ids
    ends = torch.tensor(lengths, device=ids.device)  # (B,) each row's length so far
    rows = torch.arange(b, device=ids.device)
    generator = None if sampling.greedy else sampling.generator(ids.device)
    stop_ids = torch.tensor(list(stop), dtype=torch.long, device=ids.device)
    finished = torch.zeros(b, dtype=torch.bool, device=ids.device)
    if fitting > 0:
        first = (_cached(model, ids, lengths, fitting, sampling, stop, kind, generator) if use_cache
                 else _uncached(model, ids, lengths, fitting, sampling, stop, generator))
        for new in first:
            tokens[rows, ends] = new
            ends += 1
            if stop:
                finished |= torch.isin(new, stop_ids)
            yield new
        if stop and bool(finished.all()):
            return
    yield from cropped_steps(model, tokens, ends, max_new_tokens - fitting, sampling, stop, generator, finished)


def _uncached(model: CausalDecoder, ids: Tensor, lengths: list[int], max_new_tokens: int,
              sampling: Sampling, stop: tuple[int, ...], generator: torch.Generator | None = None,
              constraint: Constraint | None = None) -> Iterator[Tensor]:
    """Every step runs each row's whole sequence again (rows stay padded at the end)."""
    b = ids.shape[0]
    tokens = torch.zeros(b, ids.shape[1] + max_new_tokens, dtype=torch.long, device=ids.device)
    tokens[:, : ids.shape[1]] = ids
    ends = torch.tensor(lengths, device=ids.device)  # (B,) each row's length so far
    rows = torch.arange(b, device=ids.device)
    if generator is None and not sampling.greedy:
        generator = sampling.generator(ids.device)
    stop_ids = torch.tensor(list(stop), dtype=torch.long, device=ids.device)
    finished = torch.zeros(b, dtype=torch.bool, device=ids.device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            with torch.inference_mode():
                logits = model(tokens[:, : int(ends.max())])[rows, ends - 1]  # (B, V)
            new = _choose(logits, sampling, generator, constraint, stop)
            if stop:
                new = _hold_finished(new, finished, stop_ids)
            tokens[rows, ends] = new
            ends += 1
            yield new
            if stop and bool(finished.all()) or constraint is not None and constraint.finished:
                return
    finally:
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
    kv_cache: CacheKind = StaticKVCache,
    on_past_context: Callable[[str], object] | None = None,
    constraint: Constraint | None = None,
) -> Tensor:
    """The prompt ids (B, T) followed by up to max_new_tokens new ones: (B, T + N).

    temperature 0 is greedy; otherwise tokens are drawn (after top_k / top_p filtering)
    from a generator seeded with `seed`. Generation stops early once every row has
    produced one of `eos_token_id`; finished rows are filled with the (first) end token.
    `attention_mask` (B, T) marks real tokens (1) and left padding (0).
    Past the context length generation goes on (qkv.generation.past_context): the line
    saying how goes to `on_past_context`, or is a UserWarning when none is given.
    `constraint` (one row): a grammar the new tokens follow, ending when it is complete.
    """
    new = list(
        stream(
            model, input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, use_cache=use_cache, eos_token_id=eos_token_id, attention_mask=attention_mask,
            kv_cache=kv_cache, on_past_context=on_past_context, constraint=constraint,
        )
    )
    if not new:
        return input_ids.clone()
    return torch.cat([input_ids.long(), torch.stack(new, dim=1).to(input_ids.device)], dim=1)  # (B, T + N)
