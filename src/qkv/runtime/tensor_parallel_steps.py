"""Decode sessions shared by the ranks of a tensor-parallel group: rank 0 leads, the others follow.

    session = LeadSession(model, tp, batch_size=8, capacity=1024, kind=SlotKVCache)  # rank 0's engine steps it
    follow(model, tp)                     # every other rank, until rank 0 stops (qkv serve --tensor-parallel)
    LeadSession(model, tp, capacity=512, stop_on_close=False)   # a chat's sessions; then stop_followers(tp)

Every call that runs the model or changes the caches (opening the session, prefill_row,
prefill_row_all, decode on some rows, copy_row, release_row, prefill, decode, truncate, reset,
closing) is first broadcast by
rank 0 as a plan, then run; each follower receives the plan and runs the same call on its
own session over its slice of the model, so the calls, and the all-reduces inside them, come
in the same order on every rank. The engine's batching (which rows, prefill pieces, prefix
reuse, released rows) is decided on rank 0 alone and reaches the others only as plans.

Tokens are chosen on rank 0 only (its `DecodeLoop`, from the gathered logits) and reach the
others inside the next decode plan, which carries each row's token anyway: a request's
sampling state (its generator, penalties, logit bias, grammar) then lives on rank 0 alone,
and no rank can draw a different token, even on CPUs that round a softmax differently.

Every wait is bounded. While the engine idles, rank 0 sends a heartbeat plan every
`heartbeat_s` (a quarter of the group's timeout, at most 10 s), so a follower that hears
nothing within the timeout knows rank 0 is gone, and rank 0 finds a dead follower within a
heartbeat. A lost rank (`RankLost`) fails the step that met it and every later one at once,
and `on_lost` is told once (the server stops). A model call on rank 0 outside a plan (the
explorer's traces) is refused by the model itself (`TensorParallelDecoder.unshared_refusal`).

Plans are int64 tensors: a header (op, a, b, c, n), then n ints of payload (prompt ids,
rows and tokens). Shape legend: T prompt tokens, b decoded rows, V vocabulary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from qkv.attention.caches.kv_cache import SlotKVCache, StaticKVCache
from qkv.errors import QkvError
from qkv.models.tensor_parallel.group import RankLost, TensorParallel
from qkv.runtime.session import DecodeSession

IDLE, STOP, OPEN, CLOSE, PREFILL_ROW, PREFILL_ROW_ALL, DECODE_ROWS, COPY_ROW, RELEASE_ROW, PREFILL, DECODE, \
    TRUNCATE, RESET = range(13)
KINDS = (SlotKVCache, StaticKVCache)  # the cache kinds a shared session holds, by their index in a plan
HEADER = 5  # op, a, b, c, n
REFUSAL = ("this server runs --tensor-parallel: its other ranks run only the decode steps rank 0 shares with "
           "them, so the explorer cannot trace the model here; run `qkv serve` on one process to trace")


def _plan(op: int, a: int = 0, b: int = 0, c: int = 0, payload: list[int] | Tensor = ()) -> tuple[Tensor, Tensor]:
    body = torch.as_tensor(payload, dtype=torch.long).reshape(-1)  # (n,)
    return torch.tensor([op, a, b, c, body.numel()], dtype=torch.long), body


class LeadSession(DecodeSession):
    """Rank 0's session: each call is shared with the followers, then run (module docstring).
    `stop_on_close`: closing it ends the followers (a server's one session); else they close
    theirs and wait for the next (a chat opens a larger one as the conversation grows), and
    `stop_followers` ends them."""

    def __init__(self, model: Any, tp: TensorParallel, *, on_lost: Callable[[RankLost], None] | None = None,
                 heartbeat_s: float | None = None, stop_on_close: bool = True, **options: Any) -> None:
        kind = options.pop("kind", StaticKVCache)
        if kind not in KINDS:
            raise QkvError("under --tensor-parallel the KV cache is the plain one (no --kv-cache options, no "
                           "streaming past the context); start over with /reset, or run on one process")
        super().__init__(model, kind=kind, **options)
        self.tp = tp
        self.stop_on_close = stop_on_close
        self.on_lost = on_lost
        self.lost: RankLost | None = None
        timeout = tp.timeout.total_seconds()
        self.heartbeat_s = min(10.0, timeout / 4) if heartbeat_s is None else heartbeat_s
        self._lock = threading.Lock()  # one plan (and its call's collectives) at a time
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        self._beating: threading.Thread | None = None
        model.unshared_refusal = REFUSAL

    def _send(self, header: Tensor, body: Tensor) -> None:
        self.tp.broadcast(header, "broadcast of the next step")
        if body.numel():
            self.tp.broadcast(body, "broadcast of the next step")
        self._last_sent = time.monotonic()

    def _shared(self, plan: tuple[Tensor, Tensor], run: Callable[[], Any], *, local_once_lost: bool = False) -> Any:
        """Send `plan`, then `run()` it here, with no other plan in between. Once a rank is
        lost every call raises, but one marked `local_once_lost` (freeing a row as the engine
        fails its requests) runs here alone."""
        with self._lock:
            if self.lost is not None:
                if local_once_lost:
                    return run()
                raise self.lost
            self.model.in_shared_step = True
            try:
                self._send(*plan)
                return run()
            except RankLost as error:
                self._lose(error)
                raise
            finally:
                self.model.in_shared_step = False

    def _lose(self, error: RankLost) -> None:
        if self.lost is None:
            self.lost = error
            if self.on_lost is not None:
                self.on_lost(error)

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last_sent < self.heartbeat_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if self.lost is None and not self._stopped.is_set():
                    self._send(*_plan(IDLE))
            except RankLost as error:
                self._lose(error)
                return
            finally:
                self._lock.release()

    # -- what the engine calls ---------------------------------------------------------
    def __enter__(self) -> LeadSession:
        self._shared(_plan(OPEN, self.batch_size, self.capacity, KINDS.index(self.kind)), super().__enter__)
        self._beating = threading.Thread(target=self._beat, name="qkv-tensor-parallel-heartbeat", daemon=True)
        self._beating.start()
        return self

    def close(self) -> None:
        """Close here and tell the followers to stop (nothing to tell once a rank is lost)."""
        self._stopped.set()
        if self._beating is not None:
            self._beating.join(timeout=self.heartbeat_s + 5)
        with self._lock:
            if self.lost is None and self._open:
                try:
                    self._send(*_plan(STOP if self.stop_on_close else CLOSE))
                except RankLost as error:
                    self._lose(error)
        super().close()

    def prefill_row(self, row: int, ids: Tensor, *, start: int = 0) -> Tensor:
        return self._shared(_plan(PREFILL_ROW, row, start, payload=ids),
                            lambda: super(LeadSession, self).prefill_row(row, ids, start=start))

    def prefill_row_all(self, row: int, ids: Tensor, *, start: int = 0) -> Tensor:
        return self._shared(_plan(PREFILL_ROW_ALL, row, start, payload=ids),
                            lambda: super(LeadSession, self).prefill_row_all(row, ids, start=start))

    def prefill(self, ids: Tensor, *, lengths: list[int] | None = None) -> Tensor:
        b, t = ids.shape
        payload = [*ids.reshape(-1).tolist(), *(lengths or [])]
        return self._shared(_plan(PREFILL, b, t, int(lengths is not None), payload),
                            lambda: super(LeadSession, self).prefill(ids, lengths=lengths))

    def truncate(self, length: int) -> None:
        self._shared(_plan(TRUNCATE, length), lambda: super(LeadSession, self).truncate(length))

    def reset(self) -> None:
        self._shared(_plan(RESET), super().reset)

    def decode(self, tokens: Tensor, rows: list[int] | None = None) -> Tensor:
        if rows is None:
            return self._shared(_plan(DECODE, payload=tokens), lambda: super(LeadSession, self).decode(tokens))
        return self._shared(_plan(DECODE_ROWS, len(rows), payload=[*rows, *tokens.tolist()]),
                            lambda: super(LeadSession, self).decode(tokens, rows=rows))

    def copy_row(self, source: int, target: int, length: int) -> None:
        self._shared(_plan(COPY_ROW, source, target, length),
                     lambda: super(LeadSession, self).copy_row(source, target, length))

    def release_row(self, row: int) -> None:
        self._shared(_plan(RELEASE_ROW, row), lambda: super(LeadSession, self).release_row(row), local_once_lost=True)


def _receive(tp: TensorParallel) -> tuple[Tensor, Tensor]:
    header = tp.broadcast(torch.zeros(HEADER, dtype=torch.long), "wait for rank 0's next step")
    n = int(header[4])
    body = tp.broadcast(torch.zeros(n, dtype=torch.long), "wait for rank 0's next step") if n else header[:0]
    return header, body


def _replay(session: DecodeSession, op: int, a: int, b: int, c: int, body: Tensor) -> None:
    """Run on this rank the call rank 0 shared (a follower replays rank 0's decode loop)."""
    if op == PREFILL_ROW:
        session.prefill_row(a, body, start=b)
    elif op == PREFILL_ROW_ALL:
        session.prefill_row_all(a, body, start=b)
    elif op == DECODE_ROWS:
        session.decode(body[a:], rows=body[:a].tolist())
    elif op == COPY_ROW:
        session.copy_row(a, b, c)
    elif op == RELEASE_ROW:
        session.release_row(a)
    elif op == PREFILL:
        session.prefill(body[:a * b].view(a, b), lengths=body[a * b:].tolist() if c else None)
    elif op == DECODE:
        session.decode(body)
    elif op == TRUNCATE:
        session.truncate(a)
    elif op == RESET:
        session.reset()
    else:
        raise AssertionError(f"unknown tensor-parallel step {op}")


def follow(model: Any, tp: TensorParallel, *, setup: Any = None) -> None:
    """Run rank 0's shared calls on this rank's slice `model` until rank 0 stops (module
    docstring); RankLost when rank 0 is gone or silent past the group's timeout."""
    session: DecodeSession | None = None
    try:
        while True:
            header, body = _receive(tp)
            op, a, b, c, _ = header.tolist()
            if op == IDLE:
                continue
            if op == STOP:
                return
            if op == OPEN:
                session = DecodeSession(model, batch_size=a, capacity=b, kind=KINDS[c], exact_capacity=True,
                                        setup=setup).__enter__()
                continue
            if op == CLOSE:
                if session is not None:
                    session.close()
                session = None
                continue
            if session is None:
                raise AssertionError("rank 0 shared a step before opening its session")
            try:
                _replay(session, op, a, b, c, body)
            except RankLost:
                raise
            except (QkvError, NotImplementedError):  # refused before any collective: rank 0 met the same refusal
                continue
    finally:
        if session is not None:
            session.close()


def stop_followers(tp: TensorParallel) -> None:
    """The plan that ends every follower's `follow` (once rank 0's sessions are closed)."""
    tp.broadcast(_plan(STOP)[0], "broadcast of the stop")
