"""Chunked prefill between decode steps (qkv.serve.engine.prefill): a long prompt never stalls
the running streams, a short prompt is not stuck behind it, and every answer is what the
request alone gives through qkv.generate. Counted in events and steps, never in wall time."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from qkv.generation.sampling import Sampling
from qkv.models.loader import load_pretrained
from qkv.runtime.prompt_parts import PREFILL_ALIGN
from qkv.serve.engine.batching import Engine
from qkv.serve.engine.jobs import Finished, Job
from qkv.serve.engine.prefill import (IDLE_BUDGET, SHORT_PROMPT, PieceBudget, Prefilling, key_equivalents, piece_work,
                                      plan_pieces, step_budget)

from .test_batching import _alone


def _long_prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _run(engine: Engine, jobs: list[tuple[str, list[int], int]]) -> tuple[list[tuple[str, int]], dict[str, list[int]]]:
    """Submit the jobs together; the events in the order the engine handed them off, and the tokens."""
    log: list[tuple[str, int]] = []
    tokens: dict[str, list[int]] = {name: [] for name, _, _ in jobs}
    left = [len(jobs)]
    done = threading.Event()

    def emitter(name: str):
        def emit(event) -> None:
            if isinstance(event, Finished):
                left[0] -= 1
                if left[0] == 0:
                    done.set()
                return
            log.append((name, event.id))
            tokens[name].append(event.id)
        return emit

    engine.submit_jobs([Job(ids, n, Sampling(), frozenset(), emitter(name)) for name, ids, n in jobs])
    assert done.wait(120)
    return log, tokens


def test_a_long_prompt_is_prefilled_between_the_steps_of_a_running_stream(tiny_folder: Path) -> None:
    model, tokenizer = load_pretrained(tiny_folder)
    stream = tokenizer.encode("The cat").ids
    long = _long_prompt(200, model.cfg.vocab_size)  # 4 pieces of PREFILL_ALIGN tokens at most
    engine = Engine(model, max_batch=2, capacity=256, prefill_budget=PREFILL_ALIGN)
    engine.start()
    try:
        log, tokens = _run(engine, [("long", long, 6), ("stream", stream, 30)])
    finally:
        engine.stop()
    first_long = log.index(("long", tokens["long"][0]))
    before = sum(1 for name, _ in log[:first_long] if name == "stream")
    assert before >= 3  # a token of the stream at each step while the long prompt's pieces were prefilled
    assert engine.stats.prefill_chunks >= 4
    assert tokens["long"] == _alone(model, long, 6, ()) and tokens["stream"] == _alone(model, stream, 30, ())


def test_while_streams_run_a_long_prompt_goes_in_pieces_beside_their_steps(tiny_folder: Path) -> None:
    """The default budget beside a decoding row: the long prompt's pieces go in the steps' own
    calls, the stream gets a token at every one of them, and both answers are their own alone."""
    model, tokenizer = load_pretrained(tiny_folder)
    stream, long = tokenizer.encode("The cat").ids, _long_prompt(200, model.cfg.vocab_size)
    engine = Engine(model, max_batch=2, capacity=256)
    log: list[str] = []
    tokens: dict[str, list[int]] = {"stream": [], "long": []}
    first, done = threading.Event(), threading.Event()
    left = [2]
    chunks_at: list[int] = []  # the prefill pieces done when each stream token was handed off

    def emitter(name: str):
        def emit(event) -> None:
            if isinstance(event, Finished):
                left[0] -= 1
                if left[0] == 0:
                    done.set()
                return
            log.append(name)
            tokens[name].append(event.id)
            if name == "stream":
                chunks_at.append(engine.stats.prefill_chunks)
            first.set()
        return emit

    engine.start()
    try:
        engine.submit_jobs([Job(stream, 60, Sampling(), frozenset(), emitter("stream"))])
        assert first.wait(60)
        submitted = len(log)
        engine.submit_jobs([Job(long, 4, Sampling(), frozenset(), emitter("long"))])
        assert done.wait(120)
    finally:
        engine.stop()
    pieces = engine.stats.prefill_chunks
    during = log[submitted:log.index("long")].count("stream")
    assert pieces >= 1 and during >= pieces  # a stream token at each step that computed a piece
    assert all(b - a <= 1 for a, b in zip(chunks_at, chunks_at[1:]))  # one piece a step, a stream token each
    assert tokens["long"] == _alone(model, long, 4, ()) and tokens["stream"] == _alone(model, stream, 60, ())


def test_the_piece_budget_sizes_a_piece_by_its_cost_at_its_position() -> None:
    """From a step alone and a step beside a measured piece: the work that fits keeps a step
    within `slack` of one alone, and a piece later in a prompt (more keys before each token)
    gets fewer tokens, each the most whose work fits."""
    budget = PieceBudget(keys_per_token=1000.0, slack=1.5)
    assert budget.room() is None  # nothing measured: plan_pieces counts tokens
    budget.observe(0.010, 0.0)  # a step alone: 10 ms
    budget.observe(0.020, piece_work(64, 0, 1000.0))  # beside 64 tokens at 0: 10 ms more
    room = budget.room()
    assert room is not None and abs(room - 0.5 * piece_work(64, 0, 1000.0)) < 1e-6 * room
    early, late = budget.tokens_at(0, 4000, room), budget.tokens_at(3000, 4000, room)
    assert 0 < late < early < 64
    for start, tokens in ((0, early), (3000, late)):
        assert piece_work(tokens, start, 1000.0) <= room < piece_work(tokens + 1, start, 1000.0)
    assert budget.tokens_at(0, 5, room) == 5  # at most what is left
    planned = plan_pieces({0: Prefilling("job", 8000, 3000, 0.0)}, PREFILL_ALIGN, 0, align=1, budget=budget)
    assert planned == {0: 3000 + late}
    # two long prompts share the room: the second gets what the first leaves
    two = plan_pieces({0: Prefilling("a", 8000, 3000, 0.0), 1: Prefilling("b", 9000, 0, 0.0)}, PREFILL_ALIGN, 0,
                      align=1, budget=budget)
    assert two[0] == 3000 + late and sum(piece_work(end - done, done, 1000.0) for end, done in
                                         ((two[0], 3000), (two.get(1, 0), 0))) <= room
    # cuts on parts: one part at least, so the prompt goes on
    assert plan_pieces({0: Prefilling("job", 8000, 3008, 0.0)}, PREFILL_ALIGN, 0, budget=budget) == {0: 3072}


def test_a_tokens_products_in_keys_follow_the_models_shape(tiny_folder: Path) -> None:
    model, _ = load_pretrained(tiny_folder)
    layers = list(model.attention_layers())
    c, h, d = layers[0].emb_dim, layers[0].num_heads, layers[0].head_dim
    assert key_equivalents(model) == 24.0 * c * c / (4.0 * h * d)


def test_a_short_prompt_is_not_stuck_behind_a_long_one(tiny_folder: Path) -> None:
    model, tokenizer = load_pretrained(tiny_folder)
    long = _long_prompt(230, model.cfg.vocab_size)
    short = tokenizer.encode("Keys").ids
    engine = Engine(model, max_batch=2, capacity=256, prefill_budget=2 * PREFILL_ALIGN)
    engine.start()
    try:
        log, tokens = _run(engine, [("long", long, 4), ("short", short, 4)])  # the long one came first
    finally:
        engine.stop()
    assert log[0][0] == "short"  # its first token came at the first step, before the long prompt was done
    assert tokens["long"] == _alone(model, long, 4, ()) and tokens["short"] == _alone(model, short, 4, ())


def test_the_pieces_end_on_the_parts_a_whole_prefill_computes() -> None:
    def state(length: int, done: int) -> Prefilling[str]:
        return Prefilling("job", length, done, 0.0)

    assert plan_pieces({}, 256, 0) == {}
    assert plan_pieces({0: state(1000, 0)}, 256, 0) == {0: 256}
    assert plan_pieces({0: state(1000, 10)}, 256, 0) == {0: 256}  # back on the boundary
    assert plan_pieces({0: state(1000, 0)}, 40, 0) == {0: PREFILL_ALIGN}  # one part at least
    assert plan_pieces({0: state(1000, 0), 1: state(30, 0)}, 256, 0) == {1: 30, 0: 192}  # the shortest first
    assert plan_pieces({0: state(1000, 0), 1: state(30, 0)}, 40, 0) == {1: 30}  # no room left for a part
    assert plan_pieces({0: state(300, 256)}, 256, 0) == {0: 300}
    assert plan_pieces({0: state(1000, 10)}, 40, 0, align=1) == {0: 50}  # cut anywhere: what the room holds


def test_short_prompts_are_prefilled_whole_beside_the_room_of_a_step() -> None:
    def state(length: int, done: int) -> Prefilling[str]:
        return Prefilling("job", length, done, 0.0)

    waiting = {0: state(4000, 0), 1: state(20, 0), 2: state(30, 0), 3: state(40, 10)}
    # 1, 2 and 3 have at most 64 left, 1 and 2 fit the short room; 3 (30 left) then takes the room
    assert plan_pieces(waiting, 8, 64, align=1) == {1: 20, 3: 18, 2: 30}
    assert plan_pieces(waiting, 8, 100, align=1) == {1: 20, 2: 30, 3: 40, 0: 8}


def test_the_budget_is_large_while_no_row_decodes_and_one_part_when_rows_do() -> None:
    assert step_budget(0) == (IDLE_BUDGET, SHORT_PROMPT) and IDLE_BUDGET > PREFILL_ALIGN
    assert step_budget(7) == (PREFILL_ALIGN, SHORT_PROMPT)
    assert step_budget(0, fixed=64) == step_budget(7, fixed=64) == (64, 0)


def test_of_prompts_sent_together_the_first_prefilled_gets_its_token_before_the_others_are(
        tiny_folder: Path) -> None:
    """With a fixed budget of one part: three prompts of more than half a part each, sent at
    once, one prefilled per step, each one's first token handed off before the next prompt's
    prefill (counted in the engine's prefill pieces); the answers are each prompt's alone."""
    model, _ = load_pretrained(tiny_folder)
    prompts = {name: _long_prompt(n, model.cfg.vocab_size) for name, n in (("a", 40), ("b", 41), ("c", 42))}
    engine = Engine(model, max_batch=3, capacity=256, prefill_budget=PREFILL_ALIGN)
    pieces_at_first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    done = threading.Event()

    def emitter(name: str):
        def emit(event) -> None:
            if isinstance(event, Finished):
                if len(tokens) == 3 and all(len(t) == 3 for t in tokens.values()):
                    done.set()
                return
            pieces_at_first.setdefault(name, engine.stats.prefill_chunks)
            tokens[name].append(event.id)
        return emit

    engine.start()
    try:
        engine.submit_jobs([Job(ids, 3, Sampling(), frozenset(), emitter(name)) for name, ids in prompts.items()])
        assert done.wait(60)
    finally:
        engine.stop()
    assert sorted(pieces_at_first.values()) == [1, 2, 3]  # the fewest tokens left first: a, then b, then c
    assert pieces_at_first["a"] == 1
    assert tokens == {name: _alone(model, ids, 3, ()) for name, ids in prompts.items()}


def test_prompts_sent_together_while_no_row_decodes_are_prefilled_in_one_step(tiny_folder: Path) -> None:
    """The default budget: a wave of prompts, with no row decoding, is prefilled in one step
    and every first token comes from that step; the answers are each prompt's alone."""
    model, _ = load_pretrained(tiny_folder)
    prompts = {name: _long_prompt(n, model.cfg.vocab_size) for name, n in (("a", 40), ("b", 41), ("c", 42))}
    engine = Engine(model, max_batch=3, capacity=256)
    engine.start()
    try:
        log, tokens = _run(engine, [(name, ids, 3) for name, ids in prompts.items()])
    finally:
        engine.stop()
    assert engine.stats.prefill_chunks == 3 and {name for name, _ in log[:3]} == set(prompts)
    assert tokens == {name: _alone(model, ids, 3, ()) for name, ids in prompts.items()}
