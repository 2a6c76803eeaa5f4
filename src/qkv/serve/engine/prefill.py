"""Chunked prefill: which prompt pieces the engine prefills between two decode steps, and how many.

    budget = PrefillBudget()                     # or PrefillBudget(fixed=64): the same every step
    tokens, short = budget.tokens(decoding=3)    # this step's room, and its room for short prompts
    planned = plan_pieces(prefilling, tokens, short, align=session.prompt_align)  # row -> end
    budget.prefilled(tokens=40, seconds=0.09); budget.decoded(seconds=0.02)      # what they cost

A prompt is cut where its session says a cut changes no number (`DecodeSession.prompt_align`:
anywhere where the native layers compute each token alone, else on PREFILL_ALIGN boundaries,
the parts a whole prefill computes), so its keys, values and logits are what one call would
give. The prompts with the fewest tokens left go first: a short prompt that arrives while a
long one is being prefilled is prefilled by the next step.

How many tokens a step prefills (why, in the order the rules apply):
- No row decoding: IDLE_BUDGET. No stream's gap is at stake, and prompts that arrive together
  (a wave of chats) go in one call, their first tokens all after that one call rather than
  the k-th after k steps, the weights read once for all of them.
- Rows decoding: as many tokens as cost about GAP_SHARE of a decode step (seconds per prompt
  token and per decode step measured as they run, EMA_WEIGHT to the newest), at least one
  part: a step that prefills lasts at most about (1 + GAP_SHARE) plain steps, so the
  running streams' gaps stay under twice their median while a long prompt is admitted
  beside them (benchmarks/serve/long_prompt_streams.py). A fixed 64 tokens, the old rule,
  made a step with 7 streams several plain steps long on a 2-core machine.
- Besides that room, prompts with at most SHORT_PROMPT tokens left (a chat's question after
  its reused template prefix) are prefilled whole, up to SHORT_PROMPT tokens a step: a new
  request's first token comes at the next step, not after several steps of a few tokens,
  for one longer gap of the running streams per such request.
`PrefillBudget(fixed=n)` takes n tokens every step and no short-prompt room (tests that count
steps; a server tuned by hand).

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
GAP_SHARE = 0.8  # of a decode step's time, what a step's prefill may add while rows decode
EMA_WEIGHT = 0.25  # of the newest measurement in the running estimates


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


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


@dataclass
class PrefillBudget:
    """How many prompt tokens a step prefills (module docstring), from what steps cost."""

    fixed: int | None = None
    token_seconds: float | None = None  # one prompt token's prefill, measured
    step_seconds: float | None = None  # one decode step, measured

    def tokens(self, decoding: int) -> tuple[int, int]:
        """(room, short room) for a step beside `decoding` decoding rows."""
        if self.fixed is not None:
            return self.fixed, 0
        if decoding == 0:
            return IDLE_BUDGET, SHORT_PROMPT
        if self.token_seconds is None or self.step_seconds is None:
            return PREFILL_ALIGN, SHORT_PROMPT  # nothing measured yet
        return max(1, int(GAP_SHARE * self.step_seconds / self.token_seconds)), SHORT_PROMPT

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.token_seconds = _ema(self.token_seconds, seconds / tokens)

    def decoded(self, seconds: float) -> None:
        self.step_seconds = _ema(self.step_seconds, seconds)


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
