"""Generation for the Python API and the commands, on the one decode loop (DecodeLoop).

    stream(model, input_ids (B, T), max_new_tokens, *, ...) -> iterator of (B,) new tokens
    generate(model, input_ids (B, T), max_new_tokens, *, ...) -> ids (B, T + N)
    continue_from(session, logits (B, V), max_new_tokens, *, sampling, stop) -> iterator of (B,)

`stream` opens a runtime session for one batch of prompts, prefills each row alone and runs
the loop (qkv.generation.decode_loop); `continue_from` runs the loop on a session the
caller holds (`qkv chat`, turn after turn on one long-lived session).

Batches of prompts of different lengths arrive left-padded, with `attention_mask` (B, T)
1 for real tokens and 0 for padding (transformers' convention). Each row's padding moves to
its end: every row starts at position 0 and is prefilled and decoded as if alone, in a
session of slots, as the server runs its requests, so each row produces the same tokens as
alone, with no padding mask at all.

Without the cache (`use_cache=False`) every step re-runs the whole sequence
(qkv.runtime.recompute): the reference the cache must reproduce.

Shape legend: B batch, T prompt tokens, N new tokens, V vocabulary.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.generation.constraints import Constraint
from qkv.attention.caches.kv_cache import CacheKind, SlotKVCache, StaticKVCache
from qkv.generation.decode_loop import DecodeLoop, RowRequest
from qkv.generation.past_context import ContextPlan, plan_past_context
from qkv.generation.sampling import Sampling
from qkv.models.decoder import CausalDecoder
from qkv.runtime.prepare import DecodeSetup
from qkv.runtime.recompute import RecomputeSession
from qkv.runtime.session import SMALLEST_CAPACITY, DecodeSession


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
    """From the logits (B, V) of each row's last token in an open `session`, yield up to
    `max_new_tokens` new tokens (B,), through the one decode loop (DecodeLoop).

    A row that produces a `stop` token keeps yielding it; the loop ends when every row has
    (the stop token itself is yielded and is in the cache only if another step follows).
    A `constraint` (one row) masks each step's logits by its grammar, and the loop ends when
    the grammar is complete (qkv.generation.constraints). The rows share `generator`.
    """
    if max_new_tokens < 1:
        return
    if generator is None and not sampling.greedy:
        generator = sampling.generator(logits.device)
    loop = DecodeLoop(session)
    for row in range(logits.shape[0]):
        loop.start(row, logits[row], RowRequest(sampling, tuple(stop), max_new_tokens, generator,
                                                constraint if row == 0 else None))
    yield from _steps(loop, logits.shape[0], stop, logits.device)


def _steps(loop: DecodeLoop, batch: int, stop: Sequence[int], device: torch.device) -> Iterator[Tensor]:
    """The loop's choices as (B,) tensors per step: a row that has ended yields its stop token."""
    held = [stop[0] if stop else 0] * batch
    while loop.running:
        new = list(held)
        for choice in loop.step():
            if choice.end == "error":
                raise QkvError(choice.message)
            new[choice.row] = choice.token
        yield torch.tensor(new, dtype=torch.long, device=device)


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
    setup: DecodeSetup | None = None,
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
    return _generated(model, ids, lengths, max_new_tokens, sampling, stop, plan, use_cache, constraint, setup)


def _generated(model: CausalDecoder, ids: Tensor, lengths: list[int], max_new_tokens: int, sampling: Sampling,
               stop: tuple[int, ...], plan: ContextPlan, use_cache: bool,
               constraint: Constraint | None, setup: DecodeSetup | None) -> Iterator[Tensor]:
    """Each prompt row prefilled alone in a session, then the one decode loop. Without a
    cache every step runs each row's sequence again (RecomputeSession); past the context of
    a model with learned positions, the cache serves while the tokens fit and then each step
    runs the last context_length tokens again (qkv.generation.past_context)."""
    b = ids.shape[0]
    generator = None if sampling.greedy else sampling.generator(ids.device)
    rows = [ids[r, :n].tolist() for r, n in enumerate(lengths)]  # each row's tokens so far
    ended = [False] * b
    fitting = max_new_tokens
    if plan.crop:  # as many new tokens as fit the context the usual way, the rest cropped
        longest = max(lengths)
        fitting = min(max_new_tokens, model.context_length - longest + 1) if longest <= model.context_length else 0
    phases = [(fitting, use_cache), (max_new_tokens - fitting, False)]
    for steps, cached in phases:
        if steps <= 0 or all(ended):
            continue
        if cached:
            capacity = min(ids.shape[1] + max_new_tokens, model.context_length)  # a sink cache may go past it
            session: DecodeSession | RecomputeSession = DecodeSession(
                model, batch_size=b, capacity=capacity, kind=_row_kind(plan.kind, setup), setup=setup)
        else:
            session = RecomputeSession(model, batch_size=b, window=model.context_length if plan.crop else None)
        with session:
            loop = DecodeLoop(session)
            going = [r for r in range(b) if not ended[r]]
            prompts = [torch.tensor(rows[r], device=ids.device) for r in going]
            if session.decodes_rows:  # each row prefilled alone: its numbers do not depend on the others
                firsts = [session.prefill_row(r, p) for r, p in zip(going, prompts)]
            else:  # a kind without slots (quantized, sink caches): one prefill of the padded rows
                assert isinstance(session, DecodeSession)
                firsts = list(session.prefill(ids, lengths=lengths))
            for row, logits in zip(going, firsts):
                loop.start(row, logits, RowRequest(sampling, stop, steps, generator, constraint if row == 0 else None))
            for new in _steps(loop, b, stop, ids.device):
                for r in going:
                    if not ended[r]:
                        rows[r].append(int(new[r]))
                        ended[r] = int(new[r]) in stop
                yield new
                going = [r for r in going if not ended[r]]


def _row_kind(kind: CacheKind, setup: DecodeSetup | None) -> CacheKind:
    """The cache kind a generation's session uses: slots (rows prefilled and decoded alone,
    as a server decodes them) for the full cache, unless Inductor compiled the model's layers,
    whose graphs keep one static shape; other kinds as asked."""
    if kind is not StaticKVCache:
        return kind
    compiled = setup is not None and setup.layer_step is None and setup.compile is not None and setup.compile.compiled
    return StaticKVCache if compiled else SlotKVCache


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
    setup: DecodeSetup | None = None,
) -> Tensor:
    """The prompt ids (B, T) followed by up to max_new_tokens new ones: (B, T + N).

    temperature 0 is greedy; otherwise tokens are drawn (after top_k / top_p filtering)
    from a generator seeded with `seed`. Generation stops early once every row has
    produced one of `eos_token_id`; finished rows are filled with the (first) end token.
    `attention_mask` (B, T) marks real tokens (1) and left padding (0).
    Past the context length generation goes on (qkv.generation.past_context): the line
    saying how goes to `on_past_context`, or is a UserWarning when none is given.
    `constraint` (one row): a grammar the new tokens follow, ending when it is complete.
    `setup`: how `model` was prepared (`qkv.load_for_generation`'s third value, or
    `qkv.runtime.prepare_for_decoding`'s), so its decode steps run as prepared (qkv's native
    layers, Inductor's graphs); None runs the layers as modules, the same numbers to float rounding.
    """
    new = list(
        stream(
            model, input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, use_cache=use_cache, eos_token_id=eos_token_id, attention_mask=attention_mask,
            kv_cache=kv_cache, on_past_context=on_past_context, constraint=constraint, setup=setup,
        )
    )
    return joined(input_ids, new)


def joined(input_ids: Tensor, new: Sequence[Tensor]) -> Tensor:
    """The prompt ids (B, T) followed by a stream's new tokens, each (B,): (B, T + N)."""
    if not new:
        return input_ids.clone()
    return torch.cat([input_ids.long(), torch.stack(list(new), dim=1).to(input_ids.device)], dim=1)  # (B, T + N)


def warm_up(model: CausalDecoder, *, capacity: int = SMALLEST_CAPACITY, kind: CacheKind = StaticKVCache,
            setup: DecodeSetup | None = None) -> float:
    """Generate three tokens through a throw-away session of `capacity` positions and caches
    of `kind`, so that a compiled model compiles its decode step (and qkv's kernels are
    ready) before anyone waits on a token. Returns the seconds it took."""
    start = time.perf_counter()
    token = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    with DecodeSession(model, capacity=min(capacity, model.context_length), kind=kind, setup=setup) as session:
        logits = session.prefill(token)
        for _ in continue_from(session, logits, 3):
            pass
    return time.perf_counter() - start
