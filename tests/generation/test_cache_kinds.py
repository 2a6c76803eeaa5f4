"""Cache kinds by name: swapped into generation without model changes, bad options refused."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.errors import QkvError
from qkv.generation import generate
from qkv.generation.cache_kinds import cache_kind, cached_perplexity
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(("name", "rope"), [("int4", "before"), ("int2", "after"), ("int2", "before"),
                                            ("sink", "after")])
def test_generation_with_a_cache_that_holds_everything_exactly_matches_the_full_cache(name: str, rope: str) -> None:
    model = tiny_llama()
    prompt = torch.randint(0, 97, (1, 12))
    full = generate(model, prompt, 30)
    kind = cache_kind(name, residual=64, window=64, sinks=4, rope=rope)  # 42 tokens: nothing leaves full precision
    assert torch.equal(generate(model, prompt, 30, kv_cache=kind), full)


def test_cached_perplexity_of_the_full_cache_is_the_whole_sequence_perplexity() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 97, (80,))
    with torch.no_grad():
        logits = model(ids[None, :-1])[0]
    expected = float(torch.nn.functional.cross_entropy(logits, ids[1:]))
    result = cached_perplexity(model, ids, StaticKVCache, capacity=80, chunk=7)
    assert math.isclose(result.nll, expected, rel_tol=1e-4) and result.tokens == 79
    sink = cached_perplexity(model, ids, cache_kind("sink", sinks=2, window=16), capacity=80, chunk=5)
    assert sink.tokens == 79 and math.isfinite(sink.nll)


def test_keys_quantized_before_rope_are_rotated_at_their_positions_when_read() -> None:
    """Quantized before RoPE (the default), the keys read back are the rotated dequantized
    keys: close to the full cache, and not the same as quantizing the rotated keys."""
    model = tiny_llama()
    ids = torch.randint(0, 97, (200,))
    full = cached_perplexity(model, ids, StaticKVCache, capacity=200, chunk=8)
    before = cached_perplexity(model, ids, cache_kind("int2", residual=16, group_size=16), capacity=200, chunk=8)
    after = cached_perplexity(model, ids, cache_kind("int2", residual=16, group_size=16, rope="after"),
                              capacity=200, chunk=8)
    assert abs(before.nll - full.nll) < 0.05 and before.nll != after.nll


@pytest.mark.parametrize(("name", "options", "message"), [
    ("int3", {}, "--kv-cache must be one of"),
    ("sink", {"window": 0}, "--window must be at least 1"),
    ("sink", {"window": 8, "sinks": 9}, "--sink-tokens must be between"),
])
def test_bad_cache_options_are_one_line_errors(name: str, options: dict, message: str) -> None:
    with pytest.raises(QkvError, match=message):
        cache_kind(name, **options)
