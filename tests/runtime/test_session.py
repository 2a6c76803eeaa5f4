"""DecodeSession on a slot cache: rows that step alone agree with each sequence decoded alone."""

from __future__ import annotations

import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.generation import generate
from qkv.runtime.session import DecodeSession
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_decoding_some_rows_matches_each_sequence_alone_and_leaves_the_others_untouched() -> None:
    model = tiny_llama()
    prompts = [torch.randint(0, 97, (n,)) for n in (5, 9, 3, 7)]
    steps = 6
    expected = [generate(model, p[None], steps)[0, p.shape[0]:].tolist() for p in prompts]

    with DecodeSession(model, batch_size=4, capacity=32, kind=SlotKVCache) as session:
        last = [int(session.prefill_row(r, p).argmax()) for r, p in enumerate(prompts)]
        produced = [[t] for t in last]
        before = [c.k_cache[1].clone() for c in session.caches]
        for _ in range(steps - 1):  # rows 0, 2 and 3 step; row 1 waits
            rows = [0, 2, 3]
            logits = session.decode(torch.tensor([last[r] for r in rows]), rows=rows)  # (3, V)
            assert logits.shape == (3, 97)
            for i, r in enumerate(rows):
                last[r] = int(logits[i].argmax())
                produced[r].append(last[r])
        for cache, kept in zip(session.caches, before):
            assert torch.equal(cache.k_cache[1], kept)  # the waiting row was not written
        for _ in range(steps - 1):  # now row 1 catches up alone
            last[1] = int(session.decode(torch.tensor([last[1]]), rows=[1])[0].argmax())
            produced[1].append(last[1])
        assert session.lengths == [p.shape[0] + steps - 1 for p in prompts]
    assert produced == expected


def test_rows_read_only_the_positions_they_reach() -> None:
    from qkv.attention.caches.kv_cache import CacheSpec

    spec = CacheSpec(batch_size=3, num_kv_heads=2, capacity=256, head_dim=4, value_dim=4,
                     dtype=torch.float32, device=torch.device("cpu"))
    cache = SlotKVCache(spec)
    k = torch.randn(2, 2, 1, 4)
    cache.selection.rows, cache.selection.limit = torch.tensor([2, 0]), 64
    keys, values, visible = cache.update(k, k, torch.tensor([[10], [3]]))
    assert keys.shape == (2, 2, 64, 4) and visible.shape == (2, 1, 1, 64)
    assert torch.equal(keys[0, :, 10], k[0, :, 0]) and torch.equal(keys[1, :, 3], k[1, :, 0])
    assert visible[0, 0, 0, :11].all() and not visible[0, 0, 0, 11:].any()
    cache.selection.limit = None
    assert cache.update(k, k, torch.tensor([[11], [4]]))[0].shape == (2, 2, 256, 4)


def test_a_copied_row_continues_as_its_own_prefill_would() -> None:
    """copy_row: a prompt prefilled once serves a second row (n answers to one prompt);
    prefill_row_all's rows are the uncached model's logits at every prompt position."""
    model = tiny_llama()
    prompt = torch.randint(0, 97, (7,))
    with torch.inference_mode():
        reference = model(prompt[None])[0]  # (T, V)
    with DecodeSession(model, batch_size=3, capacity=32, kind=SlotKVCache) as session:
        every = session.prefill_row_all(0, prompt)  # (T, V)
        torch.testing.assert_close(every, reference, atol=1e-5, rtol=1e-5)
        session.decode(torch.tensor([5]), rows=[0])  # row 0 moves on past the prompt
        session.copy_row(0, 2, prompt.shape[0])  # row 2 takes the prompt's positions only
        assert session.lengths[2] == prompt.shape[0]
        copied = session.decode(torch.tensor([11]), rows=[2])[0]
        session.prefill_row(1, prompt)
        fresh = session.decode(torch.tensor([11]), rows=[1])[0]
    torch.testing.assert_close(copied, fresh, atol=1e-5, rtol=1e-5)


def test_a_prompts_pieces_run_the_head_on_one_position_each() -> None:
    """prefill_row's aligned pieces (runtime.prompt_parts.PREFILL_ALIGN) before the last keep only
    their cache: the head never multiplies a piece's every position."""
    model = tiny_llama()
    rows_through_head: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows_through_head.append(args[0].shape[1]))
    try:
        with DecodeSession(model, capacity=128, kind=SlotKVCache) as session:
            session.prefill_row(0, torch.randint(0, 97, (100,)), start=20)  # pieces [20, 64), [64, 120)
    finally:
        hook.remove()
    assert rows_through_head == [1, 1]


def test_a_prompts_next_token_logits_are_computed_alone_as_they_are_among_all() -> None:
    """prefill_row runs the head on the last position only: the same numbers as the last row of
    prefill_row_all, which scores every position, and the same cache for what follows."""
    from qkv.models.configs.gpt2 import GPTConfig
    from qkv.models.gpt2 import GPT2Decoder

    torch.manual_seed(0)
    gpt2 = GPT2Decoder(GPTConfig(vocab_size=97, context_length=128, emb_dim=32, n_heads=4, n_layers=2,
                                 drop_rate=0.0, qkv_bias=True)).eval()
    ids = torch.randint(0, 97, (100,))  # more than one aligned piece (runtime.prompt_parts.PREFILL_ALIGN)
    for model in (tiny_llama(), gpt2):
        with DecodeSession(model, batch_size=2, capacity=120, kind=SlotKVCache) as session:
            last = session.prefill_row(0, ids)
            every = session.prefill_row_all(1, ids)
            assert every.shape == (100, 97) and last.shape == (97,)
            torch.testing.assert_close(last, every[-1], rtol=0, atol=1e-5)
            step = session.decode(torch.tensor([7, 7]))  # (2, V): both rows continue alike
            torch.testing.assert_close(step[0], step[1], rtol=0, atol=1e-5)
