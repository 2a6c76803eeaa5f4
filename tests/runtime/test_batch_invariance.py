"""Batch invariance: a request's numbers do not depend on what else runs beside it.

Each test compares a row computed beside others (or after a reused prefix) with the same row
computed alone, bit for bit, at every precision whose kernels run here: the README says what
is and is not bit-identical and why.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.generation import generate
from qkv.generation.sampling import Sampling
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.runtime.native import native_kernels
from qkv.runtime import DecodeSession, DecodeSetup, prepare_for_decoding, reusable_prefix
from qkv.runtime.prompt_parts import PREFILL_ALIGN, aligned_parts
from qkv.serve.engine.batching import Engine
from qkv.serve.engine.jobs import Finished

PRECISIONS = ["float32", "int8", "int4"]
needs_kernels = pytest.mark.skipif(not native_kernels().available, reason="qkv's kernels do not build here")


def _model(precision: str) -> tuple[LlamaForCausalLM, DecodeSetup]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model, prepare_for_decoding(model, precision=precision, compile=True, inductor=False)


def _prompts(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g) for _ in range(n)]


@needs_kernels
@pytest.mark.parametrize("precision", PRECISIONS)
def test_rows_decoded_together_equal_each_row_alone_bit_for_bit(precision: str) -> None:
    model, setup = _model(precision)
    prompts = _prompts(4)
    with torch.inference_mode(), DecodeSession(model, batch_size=4, capacity=64, kind=SlotKVCache,
                                               setup=setup) as session:
        assert session.runs_native
        firsts = [session.prefill_row(r, p) for r, p in enumerate(prompts)]
        tokens = torch.stack([f.argmax() for f in firsts])
        together = [session.decode(tokens, rows=[0, 1, 2, 3]) for _ in range(1)][0]  # (4, V)
        alone = []
        for r, p in enumerate(prompts):
            session.prefill_row(r, p)
            alone.append(session.decode(tokens[r:r + 1], rows=[r])[0])
    for r in range(4):
        assert torch.equal(together[r], alone[r]), f"row {r} differs by {(together[r] - alone[r]).abs().max()}"


@needs_kernels
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_reused_prefix_writes_what_a_whole_prefill_writes(precision: str) -> None:
    """The part a prefill computes after a kept prefix (`reusable_prefix`) gives the numbers
    of the whole prompt prefilled at once: the last logits and every cached key."""
    model, setup = _model(precision)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 128, (300,), generator=g)
    kept = reusable_prefix(300, 290)
    assert kept == 256 == 4 * PREFILL_ALIGN and reusable_prefix(100, 100) == PREFILL_ALIGN
    assert aligned_parts(100, 300) == [(100, 128), (128, 192), (192, 256), (256, 300)]
    with torch.inference_mode(), DecodeSession(model, batch_size=2, capacity=512, kind=SlotKVCache,
                                               setup=setup) as session:
        whole = session.prefill_row(0, prompt)
        session.prefill_row(1, prompt[:kept])
        after = session.prefill_row(1, prompt[kept:], start=kept)
        assert torch.equal(whole, after)
        for cache in session.caches:
            assert torch.equal(cache.k_cache[0, :, :300], cache.k_cache[1, :, :300])


@needs_kernels
@pytest.mark.parametrize("precision", PRECISIONS)
def test_where_native_layers_run_prompts_a_prefix_cut_anywhere_writes_what_a_whole_prefill_writes(
        precision: str) -> None:
    """`prompt_align` 1 (each token computed alone): a prefill after a kept prefix of any
    length gives the whole prompt's last logits and cached keys, bit for bit."""
    model, setup = _model(precision)
    prompt = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode(), DecodeSession(model, batch_size=2, capacity=128, kind=SlotKVCache,
                                               setup=setup) as session:
        assert session.prompt_align == 1
        whole = session.prefill_row(0, prompt)
        for kept in (1, 23, 49):
            assert reusable_prefix(50, kept, session.prompt_align) == kept
            session.prefill_row(1, prompt[:kept])
            after = session.prefill_row(1, prompt[kept:], start=kept)
            assert torch.equal(whole, after), kept
            for cache in session.caches:
                assert torch.equal(cache.k_cache[0, :, :50], cache.k_cache[1, :, :50])
    with DecodeSession(model, batch_size=2, capacity=128, kind=SlotKVCache) as modules:
        assert modules.prompt_align == PREFILL_ALIGN  # the modules' products block by the row count


@needs_kernels
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_engine_gives_each_request_its_alone_tokens(precision: str) -> None:
    """Six requests at once through the server's engine, each equal token for token to the
    same prompt alone through `generate` (64 greedy tokens), and to itself sent alone."""
    model, setup = _model(precision)
    prompts = [p.tolist() for p in _prompts(6, seed=7)]
    expected = [generate(model, torch.tensor([p]), 64, setup=setup)[0, len(p):].tolist() for p in prompts]

    def served(batch: list[list[int]]) -> list[list[int]]:
        engine = Engine(model, max_batch=8, capacity=128, setup=setup)
        got: list[list[int]] = [[] for _ in batch]
        ends: list[Finished | None] = [None] * len(batch)
        done = threading.Event()

        def emitter(i: int):
            def emit(item) -> None:
                if isinstance(item, Finished):
                    ends[i] = item
                    if all(e is not None for e in ends):
                        done.set()
                else:
                    got[i].append(item.id)
            return emit

        engine.start()
        try:
            for i, ids in enumerate(batch):
                engine.submit(ids, max_tokens=64, sampling=Sampling(), stop_ids=frozenset(), emit=emitter(i))
            assert done.wait(120)
        finally:
            engine.stop()
        return got

    assert served(prompts) == expected
    assert served(prompts[2:3]) == expected[2:3]


def test_generate_rows_of_a_batch_equal_each_row_alone() -> None:
    """The Python API: a batch of prompts gives each row the tokens it gets alone (the
    modules here, no kernels needed: each row is prefilled and decoded as a row of slots)."""
    model, setup = _model("float32")
    reference = copy.deepcopy(model)
    prompts = _prompts(3, seed=11)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = p, 1  # left padding
    batch = generate(model, ids, 16, attention_mask=mask, setup=setup)[:, width:]
    for r, p in enumerate(prompts):
        assert torch.equal(batch[r], generate(reference, p[None], 16)[0, len(p):])
