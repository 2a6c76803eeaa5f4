"""Chunked prefill: which prompt pieces the engine prefills between two decode steps, and how many.

    room, short = step_budget(decoding=3)        # this step's room, and its room for short prompts
    planned = plan_pieces(prefilling, room, short, align=session.prompt_align)  # row -> end

A prompt is cut where its session says a cut changes no number (`DecodeSession.prompt_align`:
anywhere where the native layers compute each token alone, else on PREFILL_ALIGN boundaries,
the parts a whole prefill computes), so its keys, values and logits are what one call would
give. The prompts with the fewest tokens left go first: a short prompt that arrives while a
long one is being prefilled is prefilled by the next step.

How many tokens a step prefills (why, rule by rule):
- No row decoding: IDLE_BUDGET. No stream's gap is at stake, and prompts that arrive together
  (a wave of chats) go in one call, their first tokens all after that one call rather than
  the k-th after k steps, the weights read once for all of them.
- Rows decoding: one part (PREFILL_ALIGN tokens), so the running streams get a token at every
  step whatever is being prefilled. (A room sized from measured costs, tokens worth 0.8 of a
  decode step, was tried: a small piece's measured cost per token carries the call's own cost,
  about a decode step's on 30 layers, so the room fell to a token or so a step and a 2,557-token
  prompt beside 6 streams took 311 s instead of about 20; a cost model with a per-call part
  would be needed.)
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


def step_budget(decoding: int, fixed: int | None = None) -> tuple[int, int]:
    """(room, short room) in prompt tokens for a step beside `decoding` decoding rows (module docstring)."""
    if fixed is not None:
        return fixed, 0
    return (IDLE_BUDGET if decoding == 0 else PREFILL_ALIGN), SHORT_PROMPT


def plan_pieces(prefilling: dict[int, Prefilling[J]], room: int, short: int, align: int = PREFILL_ALIGN
                ) -> dict[int, int]:
    """{row: end}: this step's pieces, positions [done, end) of each row's prompt, the fewest
    tokens left first: prompts with at most `short` tokens left (all together) whole, and the
    others within `room` tokens, cut on multiples of `align`; one part at least when nothing
    else is planned, so every prompt gets on."""
    planned: dict[int, int] = {}
    for row in sorted(prefilling, key=lambda r: (prefilling[r].left, r)):
        state = prefilling[row]
        if state.left <= short:
            planned[row] = state.prompt_length
            short -= state.left
            continue
        end = state.prompt_length if state.left <= room else (state.done + room) // align * align
        if end <= state.done:
            if planned:
                break
            end = min(state.prompt_length, (state.done // align + 1) * align)  # one part
        planned[row] = end
        room -= end - state.done
        if room <= 0:
            break
    return planned
