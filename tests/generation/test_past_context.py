"""Generation past the context length: learned positions crop the window as the book's
generate_text_simple does; RoPE models slide on with a sink cache; each says so once."""

from __future__ import annotations

import warnings

import pytest
import torch

import qkv
from qkv.attention.caches.sink_cache import SinkKVCache
from qkv.book import GPTModel as BookGPT
from qkv.book import from_qkv, generate_text_simple
from qkv.generation.past_context import SINKS, plan_past_context
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig

VOCAB = 97
CONTEXT = 24


def spread(model, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)  # logits far from ties
    return model.eval()


def gpt() -> GPT2Decoder:
    return spread(GPT2Decoder(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)))


def llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT)
    return spread(LlamaForCausalLM(cfg))


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("use_cache", [True, False])
def test_learned_positions_crop_as_the_book_does(use_cache):
    model = gpt()
    ids = prompt(10)
    with pytest.warns(UserWarning, match=r"pass the context length \(24\).*last 24 tokens"):
        ours = qkv.generate(model, ids, 40, use_cache=use_cache)
    book = generate_text_simple(from_qkv(model).eval(), ids, 40, CONTEXT)  # the book's own loop and model
    assert torch.equal(ours, book)


def test_a_prompt_longer_than_the_context_is_cropped():
    model = gpt()
    ids = prompt(CONTEXT + 9)
    with pytest.warns(UserWarning):
        ours = qkv.generate(model, ids, 5)
    assert torch.equal(ours, generate_text_simple(from_qkv(model).eval(), ids, 5, CONTEXT))


def test_padded_rows_past_the_context_equal_each_row_alone():
    model = gpt()
    rows = [prompt(4, 2)[0], prompt(11, 3)[0]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = qkv.generate(model, ids, 30, attention_mask=mask)
        for i, r in enumerate(rows):
            alone = qkv.generate(model, r[None], 30)
            assert torch.equal(batch[i, width:], alone[0, len(r):])


def test_rope_models_slide_with_a_sink_cache():
    model = llama()
    ids = prompt(8)
    notes: list[str] = []
    ours = qkv.generate(model, ids, 60, on_past_context=notes.append)
    assert len(notes) == 1 and "sink cache" in notes[0]
    plan = plan_past_context(model, 8, 60, qkv.generation.loop.StaticKVCache, use_cache=True)
    assert not plan.crop
    assert ours.shape == (1, 68)
    window = CONTEXT - SINKS - max(1, CONTEXT // 4)
    explicit = qkv.generate(model, ids, 60, kv_cache=SinkKVCache.kind(sinks=SINKS, window=window, prefill_chunk=CONTEXT // 4))
    assert torch.equal(ours, explicit)
    within = qkv.generate(model, ids, CONTEXT - 8)  # while nothing is evicted, the tokens are the full cache's
    fits = SINKS + window - 8
    assert torch.equal(ours[:, : 8 + fits], within[:, : 8 + fits])


def test_nothing_is_said_when_it_fits():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qkv.generate(gpt(), prompt(10), CONTEXT - 10 + 1)  # the last token is never fed back: it fits
    assert BookGPT  # the book's class is what crop reproduces (above)
