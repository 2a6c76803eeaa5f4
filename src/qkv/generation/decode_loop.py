"""The one decode loop: every token qkv generates comes out of `DecodeLoop.step`.

    loop = DecodeLoop(session)                        # a runtime session (qkv.runtime)
    loop.start(row, logits (V,), RowRequest(...))     # a row whose prompt is prefilled
    for choice in loop.step(): ...                    # each running row's next token, then one decode call

`qkv generate`, `qkv chat`, the Python API (`qkv.generation.stream`), `qkv explain
--generate`, the server's engine and the benchmarks all run it, so one rule decides what a
row does next (`choose_next`): the logits are masked by the row's grammar (if any), biased
and penalised (`adjust_logits`), sampled with the row's own generator; a stop token, a
complete grammar or the row's token budget ends it. A row that ends is not decoded again
(and, in a session of slots, its row is released); the rows that go on step together in
one call of the session, each at its own position. Rows join (`start`) and leave
(`finish`) between steps: a server's continuous batch is this loop plus a queue.

Each row draws from its own generator and is decoded in a row-independent way by the
runtime, so a row's tokens do not depend on which other rows run beside it.

Shape legend: V vocabulary, b running rows.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.generation.constraints import Constraint
from qkv.generation.sampling import Sampling, choose

Alternatives = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class RowSession(Protocol):
    """What the loop needs of a session (qkv.runtime.DecodeSession, RecomputeSession)."""

    batch_size: int
    decodes_rows: bool  # decode(tokens, rows=...) steps only those rows

    def decode(self, tokens: Tensor, rows: list[int] | None = None) -> Tensor: ...

    def release_row(self, row: int) -> None: ...


@dataclass
class RowRequest:
    """How one row generates: sampling, its generator (None: greedy, or a fresh one),
    the tokens that end it, its budget of new tokens, a grammar, and how many alternatives
    to score per token (`logprobs`: None for none, 0 for the chosen token only)."""

    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: Collection[int] = ()
    max_tokens: int = 256
    generator: torch.Generator | None = None
    constraint: Constraint | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise QkvError(f"a row generates at least one token, got max_tokens={self.max_tokens}")


@dataclass(frozen=True)
class StepToken:
    """A row's token at one step. `end`: None while the row goes on, else why it ended
    ('stop': a stop token or a complete grammar; 'length': its budget; 'error': its
    grammar failed, `message` says how, and `token` is -1). `stop_token`: the token is one
    of the row's stop ids (it ends the answer and is no part of its text)."""

    row: int
    token: int
    logprob: float | None = None
    top: Alternatives = ()
    end: str | None = None
    stop_token: bool = False
    message: str = ""


def scored(logprobs: Tensor, chosen: Tensor, k: int) -> tuple[list[float], list[Alternatives]]:
    """logprobs (T, V), chosen (T,) -> each row's chosen logprob and its k best."""
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()  # (T,)
    if k == 0:
        return picked, [() for _ in picked]
    values, ids = logprobs.topk(k, dim=-1)  # (T, k)
    return picked, [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@dataclass
class _Row:
    request: RowRequest
    logits: Tensor | None  # (1, V): the logits the next token is chosen from
    produced: int = 0
    counts: Tensor | None = None  # (V,) generated tokens, for the penalties


def choose_next(row: int, state: _Row) -> StepToken:
    """The one stop rule (module docstring): row `row`'s next token from its logits."""
    request, logits = state.request, state.logits
    assert logits is not None
    if request.sampling.penalised and state.counts is None:
        state.counts = torch.zeros(logits.shape[-1], device=logits.device)  # (V,)
    counts = None if state.counts is None else state.counts[None]  # (1, V)
    try:
        allowed = logits if request.constraint is None else request.constraint.mask(logits)  # (1, V)
        token = int(choose(allowed, request.sampling, request.generator, counts)[0])
        if request.constraint is not None and token not in request.stop_ids:
            request.constraint.accept(token)
    except QkvError as error:  # this row's grammar failed: the other rows go on
        return StepToken(row, -1, end="error", message=str(error))
    logprob, top = None, ()
    if request.logprobs is not None:
        picked, alternatives = scored(torch.log_softmax(logits.float(), dim=-1),
                                      torch.tensor([token], device=logits.device), request.logprobs)
        logprob, top = picked[0], alternatives[0]
    if token in request.stop_ids:
        return StepToken(row, token, logprob, top, end="stop", stop_token=True)
    state.produced += 1
    if state.counts is not None:
        state.counts[token] += 1
    if request.constraint is not None and request.constraint.finished:
        return StepToken(row, token, logprob, top, end="stop")  # the grammar is complete: nothing may follow
    if state.produced >= request.max_tokens:
        return StepToken(row, token, logprob, top, end="length")
    return StepToken(row, token, logprob, top)


class DecodeLoop:
    """Rows of one session generating together (module docstring)."""

    def __init__(self, session: RowSession) -> None:
        self.session = session
        self._rows: dict[int, _Row] = {}
        self._last = [0] * session.batch_size  # each row's newest token (what an idle row feeds)

    @property
    def running(self) -> list[int]:
        return sorted(self._rows)

    def logits_of(self, row: int) -> Tensor:
        """The logits (1, V) running row `row`'s next token will be chosen from."""
        logits = self._rows[row].logits
        assert logits is not None
        return logits

    def start(self, row: int, logits: Tensor, request: RowRequest) -> None:
        """Row `row` (its prompt prefilled; `logits` (V,) or (1, V) of its last token) joins."""
        if not 0 <= row < self.session.batch_size or row in self._rows:
            raise QkvError(f"row {row} is not a free row of this session (0..{self.session.batch_size - 1})")
        self._rows[row] = _Row(request, logits.reshape(1, -1))

    def finish(self, row: int) -> None:
        """Row `row` leaves now (a cancelled request); in a session of slots its row is freed."""
        if self._rows.pop(row, None) is not None and self.session.decodes_rows:
            self.session.release_row(row)

    def step(self) -> list[StepToken]:
        """Each running row's next token (`choose_next`), then one decode call for the rows
        that go on, which gives their next logits."""
        choices = [choose_next(row, self._rows[row]) for row in self.running]
        going = [c for c in choices if c.end is None]
        for choice in choices:
            if choice.end is not None:
                self.finish(choice.row)
            else:
                self._last[choice.row] = choice.token
        if going:
            if self.session.decodes_rows:
                rows = [c.row for c in going]
                logits = self.session.decode(torch.tensor([c.token for c in going]), rows=rows)  # (b, V)
            else:  # every row steps; a row that has ended feeds its last token and is not read
                rows = list(range(self.session.batch_size))
                logits = self.session.decode(torch.tensor(self._last))  # (B, V)
            for i, row in enumerate(rows):
                if row in self._rows:
                    self._rows[row].logits = logits[i:i + 1]
        return choices
