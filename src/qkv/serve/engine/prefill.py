"""Chunked prefill: which prompt pieces the engine prefills between two decode steps, and how many.

    room, short = step_budget(decoding=3)        # this step's room, and its room for short prompts
    budget = PieceBudget(key_equivalents(model))  # beside decoding rows: pieces sized by their cost
    planned = plan_pieces(prefilling, room, short, align=session.prompt_align, budget=budget)  # row -> end
    budget.observe(seconds, work)                 # after each step: how long it took beside its pieces' work

A prompt is cut where its session says a cut changes no number (`DecodeSession.prompt_align`:
anywhere where the native layers compute each token alone, else on PREFILL_ALIGN boundaries,
the parts a whole prefill computes), so its keys, values and logits are what one call would
give. The prompts with the fewest tokens left go first: a short prompt that arrives while a
long one is being prefilled is prefilled by the next step.

How many tokens a step prefills (why, rule by rule):
- No row decoding: IDLE_BUDGET. No stream's gap is at stake, and prompts that arrive together
  (a wave of chats) go in one call, their first tokens all after that one call rather than
  the k-th after k steps, the weights read once for all of them.
- Rows decoding: the pieces go in the decode step's own call (`DecodeLoop.step(pieces=...)`,
  `DecodeSession.decode_with_pieces`), so a piece costs its tokens only, not another pass over
  the weights, and a `PieceBudget` sizes it by its cost at its position: a token's products
  cost the same anywhere, its attention grows with the keys before it, so a 64-token piece at
  position 4,000 of SmolLM2 costs about 15 decode steps where one at position 0 costs one.
  The budget keeps a step with a piece within SLACK times a step without one, measured: the
  streams' gaps stay within that of their median while a long prompt is prefilled, and the
  prompt goes on by at least one token (one part where cuts are on parts) a step. Before the
  first measurement a step takes one part (PREFILL_ALIGN tokens).
  (A room sized from measured costs was tried with the piece in a call of its own: the call
  reads the weights again, about a decode step's cost on 30 layers, so the room fell to a
  token a step and a 2,557-token prompt beside 6 streams took 311 s: the shared call is what
  makes a cost-sized piece work.)
- Besides that room, prompts with at most SHORT_PROMPT tokens left (a chat's question after
  its reused template prefix) are prefilled whole, up to SHORT_PROMPT tokens a step: a new
  request's first token comes at the next step even while a long prompt takes the room, for
  one longer gap of the running streams per such request.
A fixed budget (`step_budget(..., fixed=n)`) takes n tokens every step and no short-prompt
room (tests that count steps; a server tuned by hand).

Shape legend: T prompt tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from torch import Tensor

from qkv.runtime.prompt_parts import PREFILL_ALIGN

J = TypeVar("J")

IDLE_BUDGET = 4 * PREFILL_ALIGN  # tokens a step prefills when no row is decoding
SHORT_PROMPT = PREFILL_ALIGN  # prompts with at most this many tokens left are prefilled whole


@dataclass
class Prefilling(Generic[J]):
    """A job holding a row whose prompt is prefilled up to `done` (positions before are held)."""

    job: J
    prompt_length: int
    done: int
    admitted: float  # time.perf_counter() when it took its row
    pieces: list[Tensor] = field(default_factory=list)  # (t, V) logits, kept when the prompt is scored

    @property
    def left(self) -> int:
        return self.prompt_length - self.done


SLACK = 1.25  # a step with prompt pieces takes at most this many times a step without (the target: 2, with room)
SMOOTHING = 0.3  # the weight of the newest measurement in the budget's running estimates


def key_equivalents(model: object) -> float:
    """A token's products in units of attending one key, so that a piece's cost is one number:
    work = tokens * (this + the keys each attends). Per layer a token's products are about
    2 * 12 C^2 operations (12 C^2 weights: attention's four and a feed-forward of about 4C) and
    one key costs 4 H D (its score and its value); models without attention layers: 1,000."""
    layers = list(getattr(model, "attention_layers", lambda: [])())
    if not layers:
        return 1000.0
    products = sum(24.0 * layer.emb_dim ** 2 for layer in layers)
    per_key = sum(4.0 * layer.num_heads * layer.head_dim for layer in layers)
    return products / per_key


def piece_work(tokens: int, start: int, keys_per_token: float) -> float:
    """A piece of `tokens` at positions start.. in key units: each token's products plus its keys."""
    return tokens * (keys_per_token + start + (tokens + 1) / 2)


class PieceBudget:
    """How many prompt tokens at a position fit beside a decode step, from measured steps: the
    seconds of a step without pieces, and the extra seconds per unit of piece work (`piece_work`),
    running estimates both (SMOOTHING), so they follow the rows decoding and the positions."""

    def __init__(self, keys_per_token: float, slack: float = SLACK) -> None:
        self.keys_per_token = keys_per_token
        self.slack = slack
        self.alone: float | None = None  # seconds of a step without pieces
        self.per_work: float | None = None  # extra seconds per unit of piece work

    def observe(self, seconds: float, work: float) -> None:
        """A decode step took `seconds` with pieces of `work` beside it (0: none)."""
        if work <= 0:
            self.alone = _smoothed(self.alone, seconds)
        elif self.alone is not None:
            self.per_work = _smoothed(self.per_work, max(seconds - self.alone, 0.0) / work)

    def room(self) -> float | None:
        """The piece work (`piece_work` units) that keeps a step within `slack` times a step
        without pieces; None before both estimates exist."""
        if self.alone is None or self.per_work is None:
            return None
        return (self.slack - 1.0) * self.alone / max(self.per_work, 1e-12)

    def tokens_at(self, start: int, most: int, room: float) -> int:
        """The most tokens (at most `most`) of a piece starting at `start` whose work fits `room`."""
        low, high = 0, most
        while low < high:  # work grows with tokens: bisect
            mid = (low + high + 1) // 2
            if piece_work(mid, start, self.keys_per_token) <= room:
                low = mid
            else:
                high = mid - 1
        return low


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - SMOOTHING) * old + SMOOTHING * new


def step_budget(decoding: int, fixed: int | None = None) -> tuple[int, int]:
    """(room, short room) in prompt tokens for a step beside `decoding` decoding rows (module
    docstring); a room sized by cost comes from `PieceBudget` instead (plan_pieces' `budget`)."""
    if fixed is not None:
        return fixed, 0
    return (IDLE_BUDGET if decoding == 0 else PREFILL_ALIGN), SHORT_PROMPT


def plan_pieces(prefilling: dict[int, Prefilling[J]], room: int, short: int, align: int = PREFILL_ALIGN,
                budget: PieceBudget | None = None) -> dict[int, int]:
    """{row: end}: this step's pieces, positions [done, end) of each row's prompt, the fewest
    tokens left first: prompts with at most `short` tokens left (all together) whole, and the
    others within `room` tokens, or, once `budget` has measured steps, within the work it says
    fits (each piece sized at its own position), cut on multiples of `align`; one part at least
    when nothing else is planned, so every prompt gets on."""
    planned: dict[int, int] = {}
    work = None if budget is None else budget.room()  # piece work left this step (None: count tokens)
    for row in sorted(prefilling, key=lambda r: (prefilling[r].left, r)):
        state = prefilling[row]
        if state.left <= short:
            planned[row] = state.prompt_length
            short -= state.left
            continue
        if budget is not None and work is not None:
            room = budget.tokens_at(state.done, state.left, work)
        end = state.prompt_length if state.left <= room else (state.done + room) // align * align
        if end <= state.done:
            if planned:
                break
            end = min(state.prompt_length, (state.done // align + 1) * align)  # one part
        planned[row] = end
        if budget is not None and work is not None:
            work -= piece_work(end - state.done, state.done, budget.keys_per_token)
            if work <= 0:
                break
        else:
            room -= end - state.done
            if room <= 0:
                break
    return planned
