"""What the engine is handed and hands back: a `Job` per request, the events it emits
(`Token`, `PromptScores`, `Finished`), the `Outbox` that carries a step's events in one
hand-off, and `SharedPrompt`, what the n answers to one prompt share
(qkv.serve.engine.batching runs them).

Shape legend: V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from qkv.errors import QkvError
from qkv.generation.constraints import Constraint
from qkv.generation.decode_loop import Alternatives
from qkv.generation.sampling import Sampling


class EngineFull(QkvError):
    """Every slot is busy and the waiting queue is full."""


@dataclass(frozen=True)
class Finished:
    """The last event of a job: why it ended ('stop', 'length', 'cancelled', 'grammar': the
    request's grammar admitted no next token, 'error': the step failed)."""

    reason: str
    message: str = ""

@dataclass(frozen=True)
class Token:
    """A new token. With logprobs asked: the model's log-softmax of it and the `top` most
    likely tokens, before bias, penalties and temperature. `stop`: an end token, which ends
    the answer and is no part of its text."""

    id: int
    logprob: float | None = None
    top: Alternatives = ()
    stop: bool = False


@dataclass(frozen=True)
class PromptScores:
    """The prompt's own tokens scored: logprobs[t] of token t given the tokens before it,
    and the top alternatives there; None and () for the first token, which has no context."""

    logprobs: list[float | None]
    top: list[Alternatives]


Event = Token | PromptScores | Finished


class Outbox(Protocol):
    """Where a step's events go in one hand-off (the HTTP side: one call onto its event loop
    per step, not one per token), each as `emit(event)` on the outbox's own thread."""

    def post(self, events: list[tuple[Callable[[Event], None], Event]]) -> None: ...


@dataclass
class SharedPrompt:
    """What jobs answering one prompt share: its last logits (V,) once prefilled, its scores,
    and the rows that hold its positions now."""

    logits: torch.Tensor | None = None
    scores: PromptScores | None = None
    rows: set[int] = field(default_factory=set)
    prefilling: bool = False  # one job's prefill of it is under way: the others wait to copy it


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    emit: Callable[[Event], None]
    logprobs: int | None = None  # alternatives per token to score (0: the chosen one only)
    score_prompt: bool = False
    share: SharedPrompt | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    produced: int = 0
    cancelled: bool = False
    row: int = -1
    last: int = 0
    generator: torch.Generator | None = None
    constraint: Constraint | None = None  # a grammar the reply must follow (response_format, tools)
    outbox: Outbox | None = None  # None: `emit` is called on the engine thread, once per step

    def cancel(self) -> None:
        self.cancelled = True
