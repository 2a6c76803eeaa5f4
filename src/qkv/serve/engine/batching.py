"""Continuous batching: one thread decodes every running request together.

    engine = Engine(model, max_batch=8, capacity=2048)
    engine.start()
    job = engine.submit(prompt_ids, max_tokens=64, sampling=Sampling(), stop_ids={eos}, emit=fn)
    ...                      # emit(Token) per new token, then emit(Finished(reason)), once per step
    Job(..., outbox=box)     # or: each step's events of all such jobs in one box.post(events)
    engine.submit_jobs([Job(...), Job(...)])   # several at once (all queued, or none)
    job.cancel()             # a closed connection: the slot is freed at the next step
    engine.stop()

The engine owns one `DecodeSession` of kind `SlotKVCache`: batch row r is slot r. A new
request takes a free row, and its prompt is prefilled in pieces between decode steps, the
prompt with the fewest tokens left first, within a budget that is large while no row decodes
and one part while rows do, short prompts whole beside it (qkv.serve.engine.prefill
`step_budget`): a long prompt never stalls the running streams, a short one is not stuck
behind it, and prompts that arrive together are prefilled together.
The pieces of one step go in one call (`DecodeSession.prefill_rows`: one native call, each
row's numbers its own). Then the decoding rows (only those) decode one token per step, each
at its own position, all rows' tokens chosen in one pass (qkv.generation.sampling.choose_rows),
and a request leaves as soon as it stops, reaches max_tokens or is cancelled. Each step's
events are handed off once (an `Outbox` per event loop, or `emit` per job), as soon as its
tokens are chosen: the clients stream them while the decode call computes the next logits,
rather than one step later (a request's first token comes one step sooner).
Requests beyond the free slots wait in a bounded queue; `submit` refuses one more (EngineFull).

A freed row keeps its keys and values: a new request takes the free row that shares the
longest prefix with its prompt and prefills only the rest (qkv.serve.engine.prefix_cache; not for
a job that scores its prompt, which needs the logits at every prompt position), keeping the
part of the prefix after which the rest computes what a whole prefill would
(`qkv.runtime.reusable_prefix` at the session's `prompt_align`: all of it where the native
layers compute each token alone, such as a chat template's common start; else whole prefill
parts): an answer does not depend on what ran before it. A job may
carry a `Constraint` (qkv.generation.constraints): its row's logits are masked by the
grammar before sampling, each chosen token advances it, and the job ends when it is
complete.

Jobs that share a `SharedPrompt` (n answers to one prompt) prefill it once: a later one
copies the prompt's positions from a row that holds them (`DecodeSession.copy_row`) and
draws from the same last logits. With `logprobs`, each Token carries the model's own
log-softmax (before bias, penalties and temperature) of the chosen token and the k most
likely; with `score_prompt`, the job first receives `PromptScores` for the prompt's own
tokens (the first has none). max_tokens 0 scores the prompt and generates nothing.

Shape legend: B slots (max_batch), T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable

import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.errors import QkvError
from qkv.generation.decode_loop import StepToken, DecodeLoop, RowRequest, scored
from qkv.generation.sampling import Sampling
from qkv.runtime.prepare import DecodeSetup
from qkv.runtime.prompt_parts import reusable_prefix
from qkv.runtime.session import DecodeSession
from qkv.models.decoder import CausalDecoder
from qkv.serve.engine.prefill import PieceBudget, Prefilling, key_equivalents, piece_work, plan_pieces, step_budget
from qkv.serve.engine.jobs import EngineFull, Event, Finished, Job, Outbox, PromptScores, Token
from qkv.serve.engine.prefix_cache import RowPrefixes
from qkv.serve.engine.stats import EngineStats
from qkv.util.threads import FollowIdleCores, release_openmp_workers


class Engine:
    def __init__(self, model: CausalDecoder, *, max_batch: int = 8, capacity: int | None = None,
                 max_waiting: int | None = None, threads: FollowIdleCores | None = None,
                 prefix_reuse: bool = True, prefill_budget: int | None = None,
                 setup: DecodeSetup | None = None, session_type: Callable[..., DecodeSession] = DecodeSession) -> None:
        """prefill_budget: prompt tokens prefilled a step, every step (None: qkv.serve.engine.prefill's
        `step_budget`, by whether rows decode); setup: how `model` was prepared
        (qkv.runtime.prepare), so the slots' steps run as prepared; session_type: what holds the
        slots (tensor parallel: one that shares each step with the other ranks,
        qkv.runtime.tensor_parallel_steps)."""
        if max_batch < 1:
            raise QkvError(f"--max-batch must be at least 1, got {max_batch}")
        if prefill_budget is not None and prefill_budget < 1:
            raise QkvError(f"the prefill budget must be at least 1 token per step, got {prefill_budget}")
        self.model = model
        self.max_batch = max_batch
        capacity = model.context_length if capacity is None else min(capacity, model.context_length)
        self.session = session_type(model, batch_size=max_batch, capacity=capacity, kind=SlotKVCache, setup=setup)
        self.loop = DecodeLoop(self.session)  # the one decode loop: rows join and leave between steps
        self.capacity = self.session.capacity  # the slots' cache, rounded up (qkv.runtime.session.cache_capacity)
        self.context = capacity  # what a request may use: --context (at most the model's), never the rounding
        self.max_waiting = max_batch * 4 if max_waiting is None else max_waiting
        self.stats = EngineStats(slots=max_batch)
        self._waiting: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], object], concurrent.futures.Future[object]]] = (
            collections.deque())
        self._rows: list[Job | None] = [None] * max_batch  # a row's job: prefilling, then in the decode loop
        self._prefilling: dict[int, Prefilling[Job]] = {}  # rows whose prompt is being prefilled
        self.prefill_budget = prefill_budget
        self._budget = PieceBudget(key_equivalents(model))  # pieces beside decoding rows, sized by their cost
        self._piece_starts: list[int] = []  # where this step's pieces start (their work, once timed)
        self._outgoing: list[tuple[Job, Event]] = []  # this step's events, handed off after it
        self.prefixes = RowPrefixes(max_batch, enabled=prefix_reuse)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._threads = threads  # set torch's threads to the idle cores between steps, when given

    # -- outside the engine thread -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; the calling thread (the one that prepared the model, as a
        rule) lets its OpenMP workers go, so the engine's are the only team and keep spinning
        between a step's parallel regions (qkv.util.threads.release_openmp_workers)."""
        self.session.__enter__()
        release_openmp_workers()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="qkv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.session.close()

    def submit(self, prompt: list[int], *, max_tokens: int, sampling: Sampling,
               stop_ids: frozenset[int], emit: Callable[[Event], None], **options: object) -> Job:
        job = Job(prompt, max_tokens, sampling, stop_ids, emit, **options)  # type: ignore[arg-type]
        self.submit_jobs([job])
        return job

    def submit_jobs(self, jobs: list[Job]) -> None:
        """Queue every job, or none (EngineFull when the queue is full already)."""
        for job in jobs:
            if not job.prompt:
                raise QkvError("the prompt is empty")
            if len(job.prompt) + job.max_tokens > self.context:
                raise QkvError(f"{len(job.prompt)} prompt tokens + {job.max_tokens} new tokens exceed the server's "
                               f"context ({self.context} tokens)")
        with self._wake:
            free = sum(job is None for job in self._rows)  # a free slot takes the next waiting job
            if len(self._waiting) >= self.max_waiting + free:
                raise EngineFull(f"the server is busy ({self.max_batch} running, {len(self._waiting)} waiting); "
                                 "retry shortly")
            self._waiting.extend(jobs)
            self.stats.waiting = len(self._waiting)
            self._wake.notify()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future[object]:
        """Run `fn()` on the engine thread between two steps (so that it may run the model in a
        session of its own, e.g. to trace it, never beside a step); returns its future."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def _run_calls(self) -> None:
        while True:
            with self._wake:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)
            else:
                future.set_result(result)

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._waiting and not self._calls and not any(self._rows):
                    self._wake.wait()
                if not self._running:
                    break
            if self._threads is not None:
                self._threads.poll()
            self._run_calls()
            try:
                self._step()
            except Exception as error:  # noqa: BLE001 - every job learns of it, the server lives on
                self.prefixes.forget()  # a step that failed may have written some rows halfway
                for row, job in enumerate(self._rows):
                    if job is not None:
                        self._finish(row, Finished("error", f"{type(error).__name__}: {error}"))
            self._hand_off()
        for row, job in enumerate(self._rows):
            if job is not None:
                self._finish(row, Finished("cancelled", "the server is shutting down"))
        for job in self._waiting:
            self._emit(job, Finished("cancelled", "the server is shutting down"))
        self._hand_off()
        for _, future in self._calls:
            future.cancel()

    def _emit(self, job: Job, event: Event) -> None:
        self._outgoing.append((job, event))

    def _hand_off(self) -> None:
        """This step's events, in order: one post per outbox, the rest emitted here."""
        outgoing, self._outgoing = self._outgoing, []
        boxes: dict[int, tuple[Outbox, list[tuple[Callable[[Event], None], Event]]]] = {}
        for job, event in outgoing:
            if job.outbox is None:
                job.emit(event)
            else:
                boxes.setdefault(id(job.outbox), (job.outbox, []))[1].append((job.emit, event))
        for outbox, events in boxes.values():
            outbox.post(events)

    def _step(self) -> None:
        # Drop cancelled requests (a closed connection frees its slot here, before any work).
        for row, job in enumerate(self._rows):
            if job is not None and job.cancelled:
                self._finish(row, Finished("cancelled"))
        self._admit_waiting()
        if not self.loop.running:  # nothing decoding: the prompts alone, then their rows' first step
            self._prefill_pieces()
        pieces = self._plan_beside_step() if self.loop.running else []
        self.stats.occupied = sum(job is not None for job in self._rows)
        if not self.loop.running:
            return
        start = time.perf_counter()
        # each running row's next token, handed off before the decode call of those going on,
        # which also computes the planned prompt pieces of other rows
        choices = self.loop.step(chosen=self._deliver_all, pieces=[self._piece(row, end) for row, end in pieces],
                                 prefilled=lambda lasts: self._took_pieces(pieces, lasts))
        elapsed = time.perf_counter() - start
        self._budget.observe(elapsed, sum(piece_work(end - done, done, self._budget.keys_per_token)
                                          for (_, end), done in zip(pieces, self._piece_starts)))
        self.stats.steps += 1
        self.stats.tokens_per_second = len(choices) / elapsed if elapsed > 0 else 0.0

    def _admit_waiting(self) -> None:
        """Waiting jobs take free rows, first come first served: each starts a chunked prefill
        (`_prefill_pieces`), or copies a prompt some row holds. A job whose shared prompt is
        being prefilled waits for it, then copies it."""
        while True:
            with self._wake:
                free = [row for row, job in enumerate(self._rows) if job is None]
                job = self._waiting[0] if self._waiting and free else None
                share = job.share if job is not None else None
                source = min(share.rows) if share is not None and share.rows else None
                if job is None or not job.cancelled and source is None and share is not None and share.prefilling:
                    self.stats.waiting = len(self._waiting)
                    return
                self._waiting.popleft()
                self.stats.waiting = len(self._waiting)
            if job.cancelled:
                self._emit(job, Finished("cancelled"))
            elif source is not None:
                self._admit_copy(self.prefixes.pick(free, job.prompt)[0], job, source)
            else:
                row, donor, kept = self.prefixes.pick(free, job.prompt)
                # Only what leaves the rest computing what a whole prefill would is kept.
                keeps = self.session.keeps_every_position
                kept = reusable_prefix(len(job.prompt), kept, self.session.prompt_align) if keeps else 0
                if job.score_prompt or kept == 0:  # every prompt position's logits are needed: prefill it whole
                    donor, kept = row, 0
                self._admit(row, job, donor, kept)

    def _start(self, row: int, job: Job) -> None:
        job.row = row
        job.generator = None if job.sampling.greedy else job.sampling.generator(self.session.device)
        self._rows[row] = job

    def _admit(self, row: int, job: Job, donor: int, kept: int) -> None:
        """`job` takes `row`, its first `kept` positions copied from row `donor`; the rest is
        prefilled piece by piece between the decode steps (`_prefill_pieces`)."""
        self._start(row, job)
        self.stats.prompt_tokens += len(job.prompt)
        self.stats.prompt_tokens_reused += kept
        self.prefixes.forget(row)  # until the prefill has written it
        if donor != row and kept:
            try:
                self.session.copy_row(donor, row, kept)
            except NotImplementedError:  # a sliding-window ring that has dropped those keys: prefill it all
                kept = 0
        now = time.perf_counter()
        self.stats.queue.observe(now - job.submitted)
        self._prefilling[row] = Prefilling(job, len(job.prompt), kept, now)
        if job.share is not None:
            job.share.prefilling = True

    def _prefill_pieces(self) -> None:
        """With no row decoding: prefill prompt pieces within the idle budget, the fewest tokens
        left first (qkv.serve.engine.prefill), the pieces whose next token is all that is wanted
        in one call (`DecodeSession.prefill_rows`: one native call for all of them, each row's
        numbers its own); a prompt done joins the decode loop, and its first token is chosen and
        handed off in this step's decode."""
        if not self._prefilling:
            return
        room, short = step_budget(len(self.loop.running), self.prefill_budget)
        planned = plan_pieces(self._prefilling, room, short, self.session.prompt_align)  # row -> piece's end
        together = [row for row in planned if not self._prefilling[row].job.score_prompt]
        lasts = self.session.prefill_rows([self._piece(row, planned[row]) for row in together])
        results = self._scored_alone(planned)
        results.update(zip(together, (last[None] for last in lasts)))  # row -> (1, V)
        self._advance(planned, results)

    def _plan_beside_step(self) -> list[tuple[int, int]]:
        """Rows decoding: this step's pieces (row, end) that go in the decode call, sized by
        their cost (`PieceBudget`; a fixed --prefill-budget counts tokens instead). A prompt
        whose own tokens are scored needs every position's logits: its piece runs alone first."""
        if not self._prefilling:
            self._piece_starts = []
            return []
        room, short = step_budget(len(self.loop.running), self.prefill_budget)
        budget = self._budget if self.prefill_budget is None else None
        planned = plan_pieces(self._prefilling, room, short, self.session.prompt_align, budget)  # row -> end
        scored = {row: end for row, end in planned.items() if self._prefilling[row].job.score_prompt}
        if scored:
            self._advance(scored, self._scored_alone(scored))
        pieces = [(row, end) for row, end in planned.items() if row not in scored]
        self._piece_starts = [self._prefilling[row].done for row, _ in pieces]
        return pieces

    def _took_pieces(self, pieces: list[tuple[int, int]], lasts: list[torch.Tensor]) -> None:
        """The step computed `pieces` beside its rows: each one's last logits (V,) in `lasts`."""
        self._advance(dict(pieces), {row: last[None] for (row, _), last in zip(pieces, lasts)})

    def _scored_alone(self, planned: dict[int, int]) -> dict[int, torch.Tensor]:
        """The planned pieces of prompts whose own tokens are scored: every position's logits, (t, V) each."""
        results = {}
        for row, end in planned.items():
            if self._prefilling[row].job.score_prompt:
                _, ids, begin = self._piece(row, end)
                results[row] = self.session.prefill_row_all(row, ids, start=begin)  # (t, V)
        return results

    def _advance(self, planned: dict[int, int], results: dict[int, torch.Tensor]) -> None:
        """The planned pieces are computed: `results[row]` their logits (1 or t, V); a prompt done
        joins the decode loop."""
        for row, end in planned.items():
            state, logits = self._prefilling[row], results[row]
            self.stats.prefill_chunks += 1
            state.done = end
            if state.job.score_prompt:
                state.pieces.append(logits)
            if state.left == 0:
                del self._prefilling[row]
                self._prefilled(row, state, logits[-1:])

    def _piece(self, row: int, end: int) -> tuple[int, torch.Tensor, int]:
        """Row `row`'s prompt piece up to `end`: (row, ids (t,), start)."""
        state = self._prefilling[row]
        return row, torch.tensor(state.job.prompt[state.done:end], dtype=torch.long), state.done

    def _prefilled(self, row: int, state: Prefilling[Job], last: torch.Tensor) -> None:
        """Row `row` holds its whole prompt; `last` (1, V) are its last token's logits."""
        job = state.job
        self.stats.prefill.observe(time.perf_counter() - state.admitted)
        self.prefixes.hold(row, job.prompt)
        scores = None
        if job.score_prompt:  # prefilled whole, from position 0
            logits = torch.cat(state.pieces)  # (T, V)
            ids = torch.tensor(job.prompt, dtype=torch.long, device=logits.device)  # (T,)
            picked, top = scored(torch.log_softmax(logits[:-1].float(), dim=-1), ids[1:], job.logprobs or 0)
            scores = PromptScores([None, *picked], [(), *top])
        if job.share is not None:
            job.share.logits, job.share.scores = last[0].clone(), scores
            job.share.rows.add(row)
            job.share.prefilling = False
        self._begin(row, job, last, scores)

    def _admit_copy(self, row: int, job: Job, source: int) -> None:
        """A job whose prompt row `source` holds: copy its positions instead of prefilling."""
        share = job.share
        assert share is not None and share.logits is not None
        try:
            self.session.copy_row(source, row, len(job.prompt))
        except NotImplementedError:  # a sliding-window ring that cannot give those positions: prefill
            self._admit(row, job, row, 0)
            return
        self._start(row, job)
        self.prefixes.forget(row)
        self.prefixes.hold(row, job.prompt)
        share.rows.add(row)
        self._begin(row, job, share.logits[None], share.scores)

    def _begin(self, row: int, job: Job, logits: torch.Tensor, scores: PromptScores | None) -> None:
        if job.score_prompt and scores is not None:
            self._emit(job, scores)
        if job.max_tokens == 0:
            self._finish(row, Finished("length"))
            return
        self.loop.start(row, logits, RowRequest(job.sampling, job.stop_ids, job.max_tokens, job.generator,
                                                job.constraint, job.logprobs))

    def _deliver_all(self, choices: list[StepToken]) -> None:
        """This step's tokens to their jobs, handed off at once: the clients get them while the
        next decode call runs (decoded tokens are no reusable prefix: qkv.runtime.reusable_prefix)."""
        for choice in choices:
            job = self._rows[choice.row]
            assert job is not None
            self._deliver(job, choice)
        self._hand_off()

    def _deliver(self, job: Job, choice: StepToken) -> None:
        """Hand row `choice.row`'s new token to its job; a row that ended leaves the loop."""
        if choice.end == "error":  # the row's grammar could not go on: the request's structure, not the server
            self._finish(choice.row, Finished("grammar", choice.message))
            return
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
            self.stats.ttft.observe(now - job.submitted)
        else:
            self.stats.inter_token.observe(now - job.last_token_at)
        job.last_token_at = now
        if not choice.stop_token:
            job.last = choice.token
            job.produced += 1
            self.stats.completion_tokens += 1
        self._emit(job, Token(choice.token, choice.logprob, choice.top, stop=choice.stop_token))
        if choice.end is not None:
            self._finish(choice.row, Finished(choice.end))

    def _finish(self, row: int, event: Finished) -> None:
        job = self._rows[row]
        self._rows[row] = None
        if self._prefilling.pop(row, None) is not None and job is not None and job.share is not None:
            job.share.prefilling = False  # a waiting copy of its prompt prefills it itself
        self.loop.finish(row)
        self.session.release_row(row)
        if job is not None and job.share is not None:
            job.share.rows.discard(row)
        self.stats.occupied = sum(job is not None for job in self._rows)
        if job is not None:
            self._emit(job, event)
