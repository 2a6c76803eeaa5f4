"""Continuous batching against the reference: each request alone through qkv.generate."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from qkv.generation import generate
from qkv.generation.sampling import Sampling
from qkv.models.loader import load_pretrained
from qkv.serve.engine.batching import Engine
from qkv.serve.engine.jobs import EngineFull, Finished, Job

PROMPTS = ["The cat", "Attention is all you need, they", "Keys", "The mat. The cat sat on",
           "queries and values", "A"]


def _alone(model, ids: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    out = generate(model, torch.tensor([ids]), n, eos_token_id=eos or None)[0, len(ids):].tolist()
    return out[: out.index(eos[0])] if eos and eos[0] in out else out


def test_staggered_requests_match_each_prompt_alone(tiny_folder: Path) -> None:
    model, tokenizer = load_pretrained(tiny_folder)
    eos = model.eos_token_ids
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    lengths = [9, 3, 12, 6, 10, 7]  # different lengths: requests leave (and others join) at every step
    expected = [_alone(model, ids, n, eos) for ids, n in zip(prompts, lengths)]

    engine = Engine(model, max_batch=3, capacity=64)  # fewer slots than requests: some wait
    got: list[list[int]] = [[] for _ in prompts]
    ends: list[Finished | None] = [None] * len(prompts)
    done = threading.Event()

    def emitter(i: int):
        def emit(item):
            if isinstance(item, Finished):
                ends[i] = item
                if all(e is not None for e in ends):
                    done.set()
            elif not item.stop:  # an end token ends the answer and is not one of its tokens
                got[i].append(item.id)
        return emit

    engine.start()
    try:
        for i, (ids, n) in enumerate(zip(prompts, lengths)):
            engine.submit(ids, max_tokens=n, sampling=Sampling(), stop_ids=frozenset(eos), emit=emitter(i))
        assert done.wait(60)
    finally:
        engine.stop()
    assert got == expected
    assert engine.stats.occupied == 0 and engine.stats.waiting == 0
    assert all(e is not None and e.reason in ("length", "stop") for e in ends)


def test_a_full_queue_refuses_and_a_cancelled_job_frees_its_slot(tiny_folder: Path) -> None:
    model, tokenizer = load_pretrained(tiny_folder)
    engine = Engine(model, max_batch=1, capacity=64, max_waiting=0)
    ids = tokenizer.encode("The cat").ids
    finished = threading.Event()

    def emit(item):
        if isinstance(item, Finished):
            finished.set()

    first = engine.submit(ids, max_tokens=40, sampling=Sampling(), stop_ids=frozenset(), emit=emit)
    with pytest.raises(EngineFull, match="busy"):
        engine.submit(ids, max_tokens=4, sampling=Sampling(), stop_ids=frozenset(), emit=emit)
    first.cancel()
    engine.start()
    try:
        assert finished.wait(30)
    finally:
        engine.stop()
    assert engine.stats.occupied == 0


def test_the_engine_follows_the_idle_cores_between_steps(tiny_folder: Path, monkeypatch) -> None:
    """A server started on a busy machine does not stay on one thread: the engine asks
    FollowIdleCores between steps (what other programs keep busy is the machine's, which a
    test cannot set: the usable cores' busy time is given, every core busy, then none)."""
    import time

    from qkv.util import threads
    from qkv.util.threads import FollowIdleCores, usable_cores

    model, tokenizer = load_pretrained(tiny_folder)
    before = torch.get_num_threads()
    cores = usable_cores()
    load, busy, last = [1.0], [0.0], [time.monotonic()]

    def busy_seconds() -> float:  # every usable core busy since the last reading (load 1), or none (0)
        now = time.monotonic()
        busy[0] += (now - last[0]) * cores * load[0] + threads._cpu_seconds() - busy_seconds.own
        busy_seconds.own = threads._cpu_seconds()  # this process's own time is busy time too
        last[0] = now
        return busy[0]

    busy_seconds.own = threads._cpu_seconds()
    monkeypatch.setattr(threads, "_busy_seconds", busy_seconds)
    torch.set_num_threads(1)
    engine = Engine(model, max_batch=1, capacity=64, threads=FollowIdleCores(every=0.0))
    finished = threading.Event()
    engine.start()
    def answer() -> int:
        finished.clear()
        engine.submit(tokenizer.encode("The cat").ids, max_tokens=3, sampling=Sampling(), stop_ids=frozenset(),
                      emit=lambda item: finished.set() if isinstance(item, Finished) else None)
        assert finished.wait(30)
        return engine.call(torch.get_num_threads).result(30)  # the engine thread's count: it runs the model

    try:
        time.sleep(0.2)
        assert answer() == 1  # every core busy with other programs
        load[0] = 0.0  # the machine has gone quiet
        time.sleep(0.2)  # past a window of the busy readings
        assert answer() == cores
    finally:
        engine.stop()
        torch.set_num_threads(before)


def _run_jobs(engine: Engine, jobs: list[tuple[list[int], Sampling]], n: int) -> list[list[int]]:
    """Submit every job at once; each one's tokens (end tokens kept out)."""
    got: list[list[int]] = [[] for _ in jobs]
    left = [len(jobs)]
    done = threading.Event()

    def emitter(i: int):
        def emit(item):
            if isinstance(item, Finished):
                left[0] -= 1
                if left[0] == 0:
                    done.set()
            elif not item.stop:
                got[i].append(item.id)
        return emit

    engine.submit_jobs([Job(ids, n, sampling, frozenset(), emitter(i)) for i, (ids, sampling) in enumerate(jobs)])
    assert done.wait(60)
    return got


def test_a_seeded_request_samples_the_same_whatever_runs_beside_it(tiny_folder: Path) -> None:
    """One batched sampler for all rows, yet each row draws from its own generator."""
    model, tokenizer = load_pretrained(tiny_folder)
    prompt = tokenizer.encode("The cat").ids
    mine = Sampling(temperature=1.2, top_p=0.95, seed=11)
    engine = Engine(model, max_batch=4, capacity=64)
    engine.start()
    try:
        alone = _run_jobs(engine, [(prompt, mine)], 16)[0]
        others = [(tokenizer.encode("Keys").ids, Sampling()),
                  (tokenizer.encode("Attention is").ids, Sampling(temperature=0.7, seed=3)),
                  (prompt, Sampling(temperature=1.0, seed=12, presence_penalty=1.0))]
        beside = _run_jobs(engine, [others[0], (prompt, mine), *others[1:]], 16)
    finally:
        engine.stop()
    assert beside[1] == alone and len(alone) == 16
    assert beside[0] == _alone(model, others[0][0], 16, ())  # the greedy neighbour is qkv.generate's answer


def test_prompts_that_arrive_together_prefill_in_one_native_call_and_answer_as_alone(tiny_folder: Path) -> None:
    """A step's prompt pieces go to the native layers together (`DecodeSession.prefill_rows`),
    each row's numbers its own: every answer is the prompt's alone through qkv.generate."""
    from qkv.runtime.prepare import prepare_for_decoding

    model, tokenizer = load_pretrained(tiny_folder)
    setup = prepare_for_decoding(model, precision="float32", compile=True)
    assert setup.layer_step is not None
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:4]]
    engine = Engine(model, max_batch=4, capacity=64, setup=setup, prefill_budget=256)  # every prompt in one step
    engine.start()
    try:
        assert engine.session.runs_native
        got = _run_jobs(engine, [(ids, Sampling()) for ids in prompts], 8)
    finally:
        engine.stop()
    assert got == [generate(model, torch.tensor([ids]), 8, setup=setup)[0, len(ids):].tolist() for ids in prompts]
    assert engine.stats.prefill_chunks == len(prompts)


class RecordingOutbox:
    """An Outbox (qkv.serve.engine.jobs) that keeps each hand-off."""

    def __init__(self) -> None:
        self.posts: list[list] = []

    def post(self, events) -> None:
        self.posts.append([event for _, event in events])
        for emit, event in events:
            emit(event)


def test_each_step_hands_off_every_jobs_events_at_once(tiny_folder: Path) -> None:
    model, tokenizer = load_pretrained(tiny_folder)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:3]]
    outbox = RecordingOutbox()
    got: list[list[int]] = [[] for _ in prompts]
    done = threading.Event()

    def emitter(i: int):
        def emit(item):
            if isinstance(item, Finished):
                if i == len(prompts) - 1:
                    done.set()
            else:
                got[i].append(item.id)
        return emit

    engine = Engine(model, max_batch=3, capacity=64)
    engine.start()
    try:
        engine.submit_jobs([Job(ids, 8, Sampling(), frozenset(), emitter(i), outbox=outbox)
                            for i, ids in enumerate(prompts)])
        assert done.wait(60)
    finally:
        engine.stop()
    tokens = [[e for e in post if not isinstance(e, Finished)] for post in outbox.posts]
    assert [len(t) for t in tokens] == [3] * 8  # one post per step, a token of every job in it
    assert got == [_alone(model, ids, 8, ()) for ids in prompts]


def test_a_steps_tokens_are_handed_off_before_its_decode_call(tiny_folder: Path) -> None:
    """The clients get a step's tokens while the next logits are computed, not a step later:
    each post comes before the decode call that follows it (the answers as each prompt alone)."""
    model, tokenizer = load_pretrained(tiny_folder)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:2]]
    log: list[str] = []

    class LoggingOutbox:
        def post(self, events) -> None:
            log.append("post")
            for emit, event in events:
                emit(event)

    got: list[list[int]] = [[] for _ in prompts]
    done = threading.Event()

    def emitter(i: int):
        def emit(item):
            if isinstance(item, Finished):
                if i == len(prompts) - 1:
                    done.set()
            else:
                got[i].append(item.id)
        return emit

    engine = Engine(model, max_batch=2, capacity=64)
    decode = engine.session.decode

    def logged(tokens, rows=None):
        log.append("decode")
        return decode(tokens, rows=rows)

    engine.session.decode = logged  # the real step, its calls written down
    outbox = LoggingOutbox()  # one event loop's: one post a step for both jobs
    engine.start()
    try:
        engine.submit_jobs([Job(ids, 5, Sampling(), frozenset(), emitter(i), outbox=outbox)
                            for i, ids in enumerate(prompts)])
        assert done.wait(60)
    finally:
        engine.stop()
    assert got == [_alone(model, ids, 5, ()) for ids in prompts]
    assert log == ["post", "decode"] * 4 + ["post"]  # 5 tokens: 4 decode calls, each after its tokens went out
