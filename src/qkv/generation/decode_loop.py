"""The one decode loop: every token qkv generates comes out of `DecodeLoop.step`.

    loop = DecodeLoop(session)                        # a runtime session (qkv.runtime)
    loop.start(row, logits (V,), RowRequest(...))     # a row whose prompt is prefilled
    for choice in loop.step(): ...                    # each running row's next token, then one decode call
    loop.step(chosen=deliver)                         # deliver(choices) runs before that decode call

`qkv generate`, `qkv chat`, the Python API (`qkv.generation.stream`), `qkv explain
--generate`, the server's engine and the benchmarks all run it, so one rule decides what a
row does next: the logits of every running row are chosen from in one pass
(`qkv.generation.sampling.choose_rows`: masked by each row's grammar, if any, biased and
penalised, sampled with each row's own generator); a stop token, a complete grammar or the
row's token budget ends it (`_ended`). A row that ends is not decoded again
(and, in a session of slots, its row is released); the rows that go on step together in
one call of the session, each at its own position. Rows join (`start`) and leave
(`finish`) between steps: a server's continuous batch is this loop plus a queue.

Each row draws from its own generator and is decoded in a row-independent way by the
runtime, so a row's tokens do not depend on which other rows run beside it.

Shape legend: V vocabulary, b running rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.generation.constraints import Constraint
from qkv.generation.sampling import RowSampling, Sampling, choose_rows
from qkv.util.threads import one_thread

Alternatives = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class RowSession(Protocol):
    """What the loop needs of a session (qkv.runtime.DecodeSession, RecomputeSession)."""

    batch_size: int
    decodes_rows: bool  # decode(tokens, rows=...) steps only those rows

    def decode(self, tokens: Tensor, rows: list[int] | None = None) -> Tensor: ...

    def release_row(self, row: int) -> None: ...


class PieceSession(RowSession, Protocol):
    """A session of slots that also prefills other rows' prompt pieces in a step's call
    (qkv.runtime.DecodeSession.decode_with_pieces): a server's chunked prefill."""

    def decode_with_pieces(self, tokens: Tensor, rows: list[int], pieces: list[tuple[int, Tensor, int]]
                           ) -> tuple[Tensor, list[Tensor]]: ...

    def prefill_rows(self, pieces: list[tuple[int, Tensor, int]]) -> list[Tensor]: ...


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


def _ended(row: int, state: _Row, token: int, logprob: float | None, top: Alternatives) -> StepToken:
    """The one stop rule (module docstring), once row `row` chose `token`."""
    request = state.request
    try:
        if request.constraint is not None and token not in request.stop_ids:
            request.constraint.accept(token)
    except QkvError as error:  # this row's grammar failed: the other rows go on
        return StepToken(row, -1, end="error", message=str(error))
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
        self._batch: tuple[list[int], Tensor] | None = None  # the last decode: its rows and logits (b, V)

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
        self._batch = None

    def finish(self, row: int) -> None:
        """Row `row` leaves now (a cancelled request); in a session of slots its row is freed."""
        self._batch = None
        if self._rows.pop(row, None) is not None and self.session.decodes_rows:
            self.session.release_row(row)

    def step(self, chosen: Callable[[list[StepToken]], None] | None = None,
             pieces: list[tuple[int, Tensor, int]] | None = None,
             prefilled: Callable[[list[Tensor]], None] | None = None) -> list[StepToken]:
        """Each running row's next token (`choose_rows`, all rows in one pass), then one
        decode call for the rows that go on, which gives their next logits. `chosen(choices)`
        runs in between, the ended rows already finished: a server hands the tokens to its
        clients while the step computes the next ones, not a step later. It may `finish` rows
        (a row finished there is not decoded).

        pieces: other rows' prompt pieces (row, ids (t,), start) computed in the same call
        (`PieceSession.decode_with_pieces`, a session of slots); `prefilled(last logits)` gets
        each piece's last token's logits (V,) once the step is done (rows may `start` then)."""
        running = self.running
        if pieces and not self.session.decodes_rows:
            raise QkvError("prompt pieces beside a step need a session of slots (kind=SlotKVCache)")
        if not running:
            if pieces and prefilled is not None:
                prefilled(self._pieces_session().prefill_rows(pieces))
            return []
        states = [self._rows[row] for row in running]
        with one_thread():  # small operations over (b, V), which a second thread only waits on (qkv.util.threads)
            tokens, choices = self._choose(running, states)
        going = [c for c in choices if c.end is None]
        for choice in choices:
            if choice.end is not None:
                self.finish(choice.row)
            else:
                self._last[choice.row] = choice.token
        self._batch = None
        if chosen is not None:
            chosen(choices)
            going = [c for c in going if c.row in self._rows]
        lasts: list[Tensor] = []
        if going:
            if self.session.decodes_rows:
                rows = [c.row for c in going]
                step_tokens = tokens if len(going) == len(running) else torch.tensor([c.token for c in going])
                if pieces:
                    logits, lasts = self._pieces_session().decode_with_pieces(step_tokens, rows, pieces)  # (b, V)
                else:
                    logits = self.session.decode(step_tokens, rows=rows)  # (b, V)
            else:  # every row steps; a row that has ended feeds its last token and is not read
                rows = list(range(self.session.batch_size))
                logits = self.session.decode(torch.tensor(self._last))  # (B, V)
            for i, row in enumerate(rows):
                if row in self._rows:
                    self._rows[row].logits = logits[i:i + 1]
            self._batch = (rows, logits)
        elif pieces:
            lasts = self._pieces_session().prefill_rows(pieces)
        if pieces and prefilled is not None:
            prefilled(lasts)
        return choices

    def _pieces_session(self) -> PieceSession:
        session = self.session
        if not hasattr(session, "decode_with_pieces"):
            raise QkvError(f"{type(session).__name__} cannot prefill prompt pieces beside a step")
        return session  # type: ignore[return-value]

    def _choose(self, running: list[int], states: list[_Row]) -> tuple[Tensor, list[StepToken]]:
        """The running rows' tokens (b,) and what each means for its row (`_ended`)."""
        logits = self._logits(running, states)  # (b, V)
        failed: dict[int, str] = {}
        choosing = []
        for i, state in enumerate(states):
            request = state.request
            if request.sampling.penalised and state.counts is None:
                state.counts = torch.zeros(logits.shape[-1], device=logits.device)  # (V,)
            forbidden = None
            if request.constraint is not None:
                try:
                    forbidden = request.constraint.forbidden(logits.shape[-1])
                except QkvError as error:  # this row's grammar failed: the other rows go on
                    failed[i] = str(error)
            choosing.append(RowSampling(request.sampling, request.generator,
                                        None if state.counts is None else state.counts[None], forbidden))
        tokens = choose_rows(logits, choosing)  # (b,)
        picked = tokens.tolist()
        scores = self._scores(logits, tokens, states)
        choices = []
        for i, (row, state) in enumerate(zip(running, states)):
            if i in failed:
                choices.append(StepToken(row, -1, end="error", message=failed[i]))
            else:
                choices.append(_ended(row, state, picked[i], *scores.get(i, (None, ()))))
        return tokens, choices

    def _logits(self, running: list[int], states: list[_Row]) -> Tensor:
        """The running rows' logits (b, V): the last decode's output as it is when those rows
        are the ones it stepped, else one copy of each row's."""
        if self._batch is not None and self._batch[0] == running:
            return self._batch[1]
        parts = [state.logits for state in states]
        assert all(part is not None for part in parts)
        return torch.cat(parts)  # type: ignore[arg-type]

    @staticmethod
    def _scores(logits: Tensor, tokens: Tensor, states: list[_Row]) -> dict[int, tuple[float, Alternatives]]:
        """For the rows that asked for logprobs: the model's own log-softmax (before the grammar,
        bias, penalties and temperature) of the chosen token and the k best, in one pass."""
        asking = [i for i, state in enumerate(states) if state.request.logprobs is not None]
        if not asking:
            return {}
        k = max(states[i].request.logprobs or 0 for i in asking)
        picked, top = scored(torch.log_softmax(logits[asking].float(), dim=-1), tokens[asking], k)
        return {i: (p, t[:states[i].request.logprobs or 0]) for i, p, t in zip(asking, picked, top)}
