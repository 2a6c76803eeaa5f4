"""Prompt-prefix reuse: a request that shares a prefix with what a freed slot row holds
prefills only the rest, and its tokens equal those of the same request alone."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.generation import generate
from qkv.generation.sampling import Sampling
from qkv.runtime.prompt_parts import PREFILL_ALIGN, reusable_prefix
from qkv.runtime.session import DecodeSession
from qkv.models.loader import load_pretrained
from qkv.serve.engine.batching import Engine
from qkv.serve.engine.jobs import Finished
from qkv.serve.engine.prefix_cache import RowPrefixes, common_prefix

# long enough (over two prefill parts of PREFILL_ALIGN tokens) that whole parts can be kept
SYSTEM = "Keys, queries and values. Attention is all you need, they said. " * 5


def _alone(model, ids: list[int], n: int) -> list[int]:
    return generate(model, torch.tensor([ids]), n)[0, len(ids):].tolist()


def _run(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt in turn (the next once the previous has finished), greedy, n tokens."""
    got: list[list[int]] = []
    for ids in prompts:
        out: list[int] = []
        done = threading.Event()

        def emit(item, out=out, done=done):
            if isinstance(item, Finished):
                done.set()
            elif not item.stop:
                out.append(item.id)
        engine.submit(ids, max_tokens=n, sampling=Sampling(), stop_ids=frozenset(), emit=emit)
        assert done.wait(60)
        got.append(out)
    return got


def test_reused_prefixes_give_the_tokens_of_each_request_alone(tiny_folder: Path) -> None:
    model, tokenizer = load_pretrained(tiny_folder)
    system = tokenizer.encode(SYSTEM).ids
    prompts = [system + tokenizer.encode(q).ids for q in ("The cat", "The mat sat", "Keys")]
    first = _alone(model, prompts[0], 6)
    prompts.append(prompts[0] + first[:5])  # a conversation goes on: prompt and decoded reply are cached
    expected = [_alone(model, ids, 6) for ids in prompts]
    for reuse in (True, False):
        engine = Engine(model, max_batch=3, capacity=256, prefix_reuse=reuse)
        engine.start()
        try:
            got = _run(engine, prompts, 6)
        finally:
            engine.stop()
        assert got == expected
        if reuse:  # the whole prefill parts of the system prompt, for every prompt after the first
            kept = reusable_prefix(len(prompts[1]), len(system))
            assert kept >= PREFILL_ALIGN and engine.stats.prompt_tokens_reused >= 3 * kept
        else:
            assert engine.stats.prompt_tokens_reused == 0


def test_a_row_prefilled_after_a_kept_prefix_has_the_logits_of_a_full_prefill(tiny_folder: Path) -> None:
    model, _ = load_pretrained(tiny_folder)
    ids = torch.randint(0, 280, (40,), generator=torch.Generator().manual_seed(1))
    other = torch.cat([ids[:25], torch.randint(0, 280, (9,), generator=torch.Generator().manual_seed(2))])
    with DecodeSession(model, batch_size=2, capacity=64, kind=SlotKVCache) as session:
        full = session.prefill_row(0, ids)
        session.prefill_row(1, other)  # row 1 holds 25 shared tokens, then 9 others
        reused = session.prefill_row(1, ids[25:], start=25)
        torch.testing.assert_close(reused, full, rtol=1e-4, atol=1e-4)
        steps = session.decode(torch.tensor([5, 5]), rows=[0, 1])
        torch.testing.assert_close(steps[1], steps[0], rtol=1e-4, atol=1e-4)


def test_the_row_with_the_longest_shared_prefix_is_reused() -> None:
    prefixes = RowPrefixes(3)
    prefixes.hold(0, [1, 2, 3])
    prefixes.hold(1, [1, 2, 3, 4, 5])
    prefixes.extend(1, 6)
    assert prefixes.pick([0, 1, 2], [1, 2, 3, 4, 5, 6, 7]) == (1, 1, 6)  # row 1 loses nothing
    # Row 0 would lose nothing but row 2 (empty) neither; the donor itself is preferred.
    assert prefixes.pick([0, 2], [1, 2, 3]) == (0, 0, 2)  # the last prompt token is prefilled again
    # Row 1 (busy now) shares more than any free row: the empty row 2 starts from its prefix.
    assert prefixes.pick([2], [1, 2, 3, 4, 9]) == (2, 1, 4)
    prefixes.hold(2, [7, 7])
    # Every free row would lose its tokens: the least recently used one is taken.
    assert prefixes.pick([0, 2], [1, 2, 9])[0] == 0
    prefixes.forget()
    assert prefixes.pick([0, 1], [1, 2, 3, 4])[2] == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0
    off = RowPrefixes(2, enabled=False)
    off.hold(0, [1, 2, 3])
    assert off.pick([0, 1], [1, 2, 3, 4])[2] == 0


def test_where_native_layers_run_prompts_the_whole_shared_prefix_is_reused(tiny_folder: Path) -> None:
    """A chat template's common start shorter than a prefill part: where the native layers
    compute each token alone (`prompt_align` 1) all of it is kept, and every answer is the
    request's alone through qkv.generate."""
    from qkv.runtime.prepare import prepare_for_decoding

    model, tokenizer = load_pretrained(tiny_folder)
    setup = prepare_for_decoding(model, precision="float32", compile=True)
    start = tokenizer.encode("Keys, queries and values.").ids  # under one part
    prompts = [start + tokenizer.encode(q).ids for q in (" The cat", " The mat sat", " Keys")]
    expected = [generate(model, torch.tensor([ids]), 6, setup=setup)[0, len(ids):].tolist() for ids in prompts]
    engine = Engine(model, max_batch=2, capacity=128, setup=setup)
    engine.start()
    try:
        assert engine.session.prompt_align == 1
        got = _run(engine, prompts, 6)
    finally:
        engine.stop()
    assert got == expected
    assert len(start) < PREFILL_ALIGN and engine.stats.prompt_tokens_reused >= 2 * len(start)
