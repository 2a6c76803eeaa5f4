"""Traces of qkv's decoders (loaded by qkv.load_pretrained) against transformers' eager
attentions and KV cache on the same random weights: GPT-2, Llama (grouped-query, Llama-3
RoPE), Qwen3 (q/k-norm); the KV-cache steps and the analyses of learned attention."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.attention.caches.kv_cache import KVCache
from qkv.trace.explain.analysis import key_norms, kv_groups, rope_relative, sink_share
from qkv.trace.record.generation import trace_generation

T = 10


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(5)
    return torch.randint(0, 96, (1, T))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "qwen3"])
def test_trace_weights_match_transformers_eager_attentions(kind, tiny_decoder, ids):
    folder, reference = tiny_decoder(kind)
    model, _ = qkv.load_pretrained(folder)
    with torch.no_grad():
        expected = reference(ids, output_attentions=True).attentions
    recorded = qkv.trace(model, ids)
    assert [layer.index for layer in recorded.layers] == [0, 1]
    for layer in recorded.layers:
        torch.testing.assert_close(layer.weights, expected[layer.index], atol=1e-5, rtol=1e-4)
        assert layer.causal and layer.rope == (kind != "gpt2")
    torch.testing.assert_close(recorded.output, reference(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_kv_cache_steps_match_transformers_on_the_whole_sequence(kind, tiny_decoder, ids):
    folder, reference = tiny_decoder(kind)
    model, _ = qkv.load_pretrained(folder)
    steps = trace_generation(model, ids, 3, layer=1, head=2)
    with torch.no_grad():
        greedy = reference.generate(ids, max_new_tokens=4, do_sample=False)
    fed = [step.token_id for step in steps]
    assert fed == greedy[0, T:T + 3].tolist()
    assert [step.cache_length for step in steps] == [T, T + 1, T + 2]
    with torch.no_grad():
        full = reference(greedy[:, :T + 3], output_attentions=True).attentions[1]
    for i, step in enumerate(steps):
        assert step.layer.weights.shape == (1, 1, 1, T + i + 1)  # the cache grows by one key
        torch.testing.assert_close(step.layer.weights[0, 0, 0], full[0, 2, T + i, : T + i + 1],
                                   atol=1e-5, rtol=1e-4)
    assert not any(isinstance(m, KVCache) for m in model.modules())  # the model holds no cache


def test_grouped_query_sharing_and_key_norms_match_transformers_cache(tiny_decoder, ids):
    folder, reference = tiny_decoder("llama")
    model, _ = qkv.load_pretrained(folder)
    layer = qkv.trace(model, ids, layer=1).layers[0]
    groups = kv_groups(layer)
    assert [g["query_heads"] for g in groups] == [[0, 1], [2, 3]]
    assert layer.kv_heads == [0, 0, 1, 1]
    for g in groups:
        assert 0.0 <= g["within_group_similarity"] <= 1.0
    with torch.no_grad():
        cached = reference(ids, use_cache=True).past_key_values.layers[1].keys  # (1, H_kv, T, D) rotated
    torch.testing.assert_close(torch.tensor(key_norms(layer)), cached[0].norm(dim=-1).mean(0),
                               atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        attentions = reference(ids, output_attentions=True).attentions[1]
    shares = sink_share(layer)
    for head in range(4):
        assert shares[head] == pytest.approx(float(attentions[0, head, 1:, 0].mean()), abs=1e-5)


def test_after_rope_the_score_depends_only_on_relative_position(tiny_decoder, ids):
    folder, _ = tiny_decoder("qwen3")
    model, _ = qkv.load_pretrained(folder)
    layer = qkv.trace(model, ids, layer=0, head=1).layers[0]
    demo = rope_relative(layer, 1, T - 1, 0)
    assert demo["largest_spread_at_equal_distance"] < 1e-4
    assert demo["spread_across_distances"] > 1e-2
    # The rotated query and first key are the ones the model compared: their product is the score.
    first = [p for p in demo["pairs"] if p["query_position"] == T and p["key_position"] == 1]  # from 1
    assert first[0]["score"] == pytest.approx(float(layer.scores[0, 0, -1, 0]), abs=1e-4)
    # Without RoPE (GPT-2) there is nothing to demonstrate.
    gpt_model, _ = qkv.load_pretrained(tiny_decoder("gpt2")[0])
    assert rope_relative(qkv.trace(gpt_model, ids, layer=0).layers[0], 0, 0, 0) is None
