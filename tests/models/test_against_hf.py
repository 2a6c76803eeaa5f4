"""Every decoder family against transformers on tiny random-weight checkpoints: logits,
greedy generation token for token (with and without the KV cache), cached == uncached
logits at every step. (GPT-2 with an untied head: logits in test_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.runtime import DecodeSession

CASES = {
    "gpt2": ("gpt2", {}),
    "llama-gqa-llama3-rope": ("llama", {}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-bias-tied": ("qwen2", {}),
    "qwen3-qknorm-head24": ("qwen3", {}),
}
NEW_TOKENS = 40


def prompt(batch: int = 2, tokens: int = 6) -> torch.Tensor:
    return torch.randint(0, 288, (batch, tokens), generator=torch.Generator().manual_seed(7))


@pytest.fixture(params=list(CASES))
def pair(request, shared_checkpoint):
    """(qkv model, transformers model) read from the same saved folder."""
    kind, overrides = CASES[request.param]
    folder, reference = shared_checkpoint(kind, **overrides)
    model, _ = qkv.load_pretrained(folder)
    return model, reference


def test_logits_match_transformers(pair) -> None:
    model, reference = pair
    x = prompt(tokens=20)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x).logits, rtol=0, atol=1e-4)


def test_greedy_generation_matches_transformers(pair) -> None:
    model, reference = pair
    x = prompt()
    expected = reference.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, pad_token_id=0,
    )
    cached = qkv.generate(model, x, NEW_TOKENS)
    uncached = qkv.generate(model, x, NEW_TOKENS, use_cache=False)
    assert cached.shape == (2, 6 + NEW_TOKENS)
    assert torch.equal(cached, expected)
    assert torch.equal(uncached, expected)


def test_cached_logits_equal_uncached_at_every_step(pair) -> None:
    model, reference = pair
    sequence = prompt(tokens=6 + NEW_TOKENS)  # (2, 6 + N): any tokens will do
    with torch.no_grad():
        full = model(sequence)  # (2, 6 + N, V)
        hf_full = reference(sequence).logits
    with DecodeSession(model, batch_size=2, capacity=sequence.shape[1]) as session:
        steps = [session.prefill(sequence[:, :6])]
        for i in range(6, sequence.shape[1] - 1):
            steps.append(session.decode(sequence[:, i]))
    cached = torch.stack(steps, dim=1)  # (2, N, V): logits predicting tokens 6 .. 6+N-1
    torch.testing.assert_close(cached, full[:, 5:-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(cached, hf_full[:, 5:-1], rtol=0, atol=1e-4)
