"""Chunked prefill: which prompt piece the engine prefills next, between two decode steps.

A prompt is prefilled in pieces that end on PREFILL_ALIGN boundaries (or at the prompt's
end), the same parts a whole prefill computes (qkv.runtime.prompt_parts.aligned_parts), so its
keys, values and logits are what one call would give. Between two decode steps the engine
prefills at most `budget` prompt tokens (at least one part, when nothing else was), the
prompt with the fewest tokens left first: a short prompt that arrives while a long one is
being prefilled is prefilled by the next step, and the running streams get a token at every
step whatever is being prefilled.

Shape legend: T prompt tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from torch import Tensor

from qkv.runtime.prompt_parts import PREFILL_ALIGN

J = TypeVar("J")


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


def next_piece(prefilling: dict[int, Prefilling[J]], budget: int, first: bool) -> tuple[int, int] | None:
    """(row, end): the next piece to prefill, positions [done, end) of that row's prompt, within
    `budget` tokens (`first`: nothing prefilled yet before this step, so one part at least);
    None when nothing fits."""
    if not prefilling:
        return None
    row = min(prefilling, key=lambda r: (prefilling[r].left, r))  # the fewest tokens left first
    state = prefilling[row]
    end = (state.done + budget) // PREFILL_ALIGN * PREFILL_ALIGN  # the last boundary within the budget
    if state.prompt_length <= state.done + budget:
        end = state.prompt_length
    if end <= state.done:
        if not first:
            return None
        end = min(state.prompt_length, (state.done // PREFILL_ALIGN + 1) * PREFILL_ALIGN)  # one part
    return row, end
