"""The trace records what the modules compute: checked against the book's printed numbers,
against independent recomputations with PyTorch/transformers, and against a tampered module."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from qkv.attention import GroupedQueryAttention, RotaryEmbedding, causal_mask
from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.book import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from qkv.errors import QkvError
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.trace import TraceMismatchError, trace

BOOK_INPUTS = torch.tensor(
    [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
)


def _reference_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d) + additive mask), straight from PyTorch."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])
    if mask is not None:
        scores = scores + torch.zeros_like(scores).masked_fill(~mask, -torch.inf)
    return torch.softmax(scores, dim=-1)


def test_book_example_context_is_the_books_printed_vector():
    torch.manual_seed(123)
    module = SelfAttention_v1(3, 2)
    layer = trace(module, BOOK_INPUTS, query=1).layers[0]  # x(2), "journey"
    torch.testing.assert_close(layer.context[0, 0, 0], torch.tensor([0.3061, 0.8210]), atol=1e-4, rtol=0)
    assert layer.weights.shape == (1, 1, 1, 6)
    # q · k is the sum of q ⊙ k, one score per key.
    torch.testing.assert_close(layer.products.sum(-1), layer.scores)
    torch.testing.assert_close(layer.scaled, layer.scores / math.sqrt(2))


@pytest.mark.parametrize("kind", ["v2", "causal", "mha", "wrapper"])
def test_book_classes_weights_match_pytorch(kind):
    torch.manual_seed(7)
    x = torch.rand(2, 5, 3)
    if kind == "v2":
        module, heads = SelfAttention_v2(3, 4, qkv_bias=True), 1
    elif kind == "causal":
        module, heads = CausalAttention(3, 4, 8, 0.0), 1
    elif kind == "mha":
        module, heads = MultiHeadAttention(3, 4, 8, 0.3, num_heads=2).eval(), 2
    else:
        module, heads = MultiHeadAttentionWrapper(3, 2, 8, 0.0, num_heads=2), 1
    result = trace(module, x)
    for layer in result.layers:
        sub = module.heads[layer.index] if kind == "wrapper" else module
        q = (x @ sub.W_query.weight.T + (0 if sub.W_query.bias is None else sub.W_query.bias))
        k = (x @ sub.W_key.weight.T + (0 if sub.W_key.bias is None else sub.W_key.bias))
        q = q.view(2, 5, heads, -1).transpose(1, 2)
        k = k.view(2, 5, heads, -1).transpose(1, 2)
        mask = None if kind == "v2" else causal_mask(5)
        torch.testing.assert_close(layer.weights, _reference_weights(q, k, mask))
    if kind == "mha":
        with torch.no_grad():
            torch.testing.assert_close(result.layers[0].output, module(x))


class _Tampered(MultiHeadAttention):
    """Computes something the explicit steps cannot reproduce."""

    def forward(self, x):
        return super().forward(x) + 0.01


def test_a_module_that_computes_something_else_is_refused():
    torch.manual_seed(0)
    with pytest.raises(TraceMismatchError, match="module's output"):
        trace(_Tampered(3, 4, 8, 0.0, num_heads=2), torch.rand(1, 4, 3))


def _tiny_gpt() -> GPT2Decoder:
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=60, context_length=80, emb_dim=16, n_heads=4, n_layers=2, drop_rate=0.1)
    return GPT2Decoder(cfg).eval()


def test_kv_cache_decode_step_equals_the_uncached_last_row():
    model = _tiny_gpt()
    ids = torch.randint(0, 60, (1, 7))
    full = trace(model, ids, layer=1, head=[1, 3], query=-1).layers[0]
    caches = [StaticKVCache(spec) for spec in model.cache_specs(1, 16)]
    with torch.no_grad():
        model(ids[:, :6], caches=caches)
    step = trace(model, ids[:, 6:], layer=1, head=[1, 3], caches=caches).layers[0]
    assert step.cache_length == 6 and step.num_keys == 7
    torch.testing.assert_close(step.weights, full.weights)
    torch.testing.assert_close(step.context, full.context)
    torch.testing.assert_close(step.keys, full.keys)


def test_only_the_selection_is_recorded():
    model = _tiny_gpt()
    layer = trace(model, torch.randint(0, 60, (1, 64)), layer=0, head=2, query=40).layers[0]
    assert layer.weights.shape == (1, 1, 1, 64)
    assert layer.products.shape == (1, 1, 1, 64, 4)
    assert layer.heads == [2] and layer.queries == [40]
    assert torch.all(layer.weights[0, 0, 0, 41:] == 0)  # causal: the future is hidden
    assert all(t.numel() < 64 * 64 for t in (layer.weights, layer.scores, layer.mask, layer.products))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"layer": 2}, "layer 2 is out of range"), ({"head": 4}, "head 4 is out of range"),
     ({"query": 9}, "query 9 is out of range")],
)
def test_selection_out_of_range_is_a_user_error(kwargs, message):
    with pytest.raises(QkvError, match=message):
        trace(_tiny_gpt(), torch.randint(0, 60, (1, 5)), **kwargs)


def test_training_mode_with_dropout_is_refused():
    with pytest.raises(QkvError, match="eval"):
        trace(_tiny_gpt().train(), torch.randint(0, 60, (1, 5)))


def test_a_model_without_attention_is_refused():
    with pytest.raises(QkvError, match="no attention module"):
        trace(torch.nn.Linear(3, 3), torch.rand(2, 3))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (6, 1)])
def test_grouped_query_with_rope_matches_transformers_llama_attention(num_heads, num_kv_heads):
    torch.manual_seed(num_heads)
    head_dim, hidden, t = 8, 24, 7
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    ref = LlamaAttention(config, layer_idx=0).eval()
    ours = GroupedQueryAttention(hidden, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, t, hidden)
    positions = torch.arange(t)[None]
    cos, sin = RotaryEmbedding(head_dim)(positions)
    additive = torch.zeros(1, 1, t, t).masked_fill(~causal_mask(t), torch.finfo(torch.float32).min)
    with torch.no_grad():
        _, hf_weights = ref(x, position_embeddings=LlamaRotaryEmbedding(config)(x, positions),
                            attention_mask=additive)
    layer = trace(ours, x, cos=cos, sin=sin).layers[0]
    assert layer.rope and layer.kv_heads == [h // (num_heads // num_kv_heads) for h in range(num_heads)]
    torch.testing.assert_close(layer.weights, hf_weights, atol=1e-6, rtol=1e-5)
    # Before rotation the query is the plain projection; after, its norm is unchanged.
    q_plain = (x @ ours.q_proj.weight.T).view(1, t, num_heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(layer.q_unrotated, q_plain)
    torch.testing.assert_close(layer.q.norm(dim=-1), layer.q_unrotated.norm(dim=-1))


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 9), heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_weights_are_distributions_over_visible_keys(t, heads, seed):
    torch.manual_seed(seed)
    module = MultiHeadAttention(4, 8, 10, 0.0, num_heads=heads)
    layer = trace(module, torch.randn(1, t, 4)).layers[0]
    torch.testing.assert_close(layer.weights.sum(-1), torch.ones(1, heads, t))
    assert torch.all(layer.weights[~layer.mask] == 0)
    assert torch.all(layer.weights >= 0)


@settings(max_examples=15, deadline=None)
@given(
    groups=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    cached=st.integers(0, 5),
    new=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_cached_trace_equals_the_uncached_rows(groups, cached, new, seed):
    """With a KV cache holding `cached` tokens, the trace of the `new` tokens records the same
    keys, weights and contexts as the last rows of one pass over the whole sequence."""
    num_heads, num_kv_heads = groups
    torch.manual_seed(seed)
    layer = GroupedQueryAttention(24, num_heads, num_kv_heads=num_kv_heads, head_dim=8).eval()
    rope = RotaryEmbedding(8)
    x = torch.randn(1, cached + new, 24)
    cos, sin = rope(torch.arange(cached + new))
    whole = trace(layer, x, cos=cos, sin=sin).layers[0]
    cache = StaticKVCache(layer.cache_spec(1, cached + new, dtype=torch.float32, device="cpu"))
    if cached:
        with torch.no_grad():
            layer(x[:, :cached], cos=cos[:cached], sin=sin[:cached], cache=cache)
    step = trace(layer, x[:, cached:], cos=cos[cached:], sin=sin[cached:], cache=cache).layers[0]
    assert step.cache_length == cached and step.num_keys == cached + new
    torch.testing.assert_close(step.weights, whole.weights[:, :, cached:])
    torch.testing.assert_close(step.context, whole.context[:, :, cached:])
    torch.testing.assert_close(step.keys, whole.keys)
