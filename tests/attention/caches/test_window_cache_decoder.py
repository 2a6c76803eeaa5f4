"""A decoder whose layers mix global and sliding-window attention, against transformers'
Qwen2 with the same mix (`layer_types`, its eager attention): the full forward, then
generation with one cache kind per layer (`cache_kind_for`: a full cache for the global
layer, a ring of W slots for the local ones), past the window."""

from __future__ import annotations

import pytest
import torch

from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.attention.caches.window_cache import WindowKVCache, cache_kind_for
from qkv.models.hf.checkpoint import build_from_hf
from tests.windowed_layers import make_local

WINDOW = 5


@pytest.fixture(scope="module")
def mixed_pair():
    """(qkv model with local layers 1 and 2, transformers Qwen2 with the same layer types)."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(5)
    plain = tf.Qwen2Config(**common, use_sliding_window=False)
    windowed = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                              attn_implementation="eager")
    assert windowed.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    reference = tf.Qwen2ForCausalLM(windowed).eval()
    state = {name: tensor.detach().clone() for name, tensor in reference.state_dict().items()}
    ours = build_from_hf(plain.to_dict(), state)
    for layer, kind in zip(ours.attention_layers(), windowed.layer_types):
        if kind == "sliding_attention":
            make_local(layer, WINDOW)
    return ours, reference


@torch.no_grad()
def test_the_full_forward_matches_transformers_sliding_window_layers(mixed_pair) -> None:
    ours, reference = mixed_pair
    ids = torch.randint(0, 96, (1, 17), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_per_layer_caches_decode_past_the_window_as_transformers_scores_the_sequence(mixed_pair) -> None:
    ours, reference = mixed_pair
    n, prompt = 20, 8  # a prompt longer than the window, then decode steps past it
    ids = torch.randint(0, 96, (2, n), generator=torch.Generator().manual_seed(2))
    expected = reference(ids).logits  # (B, n, V)
    layers = list(ours.attention_layers())
    specs = ours.cache_specs(2, 32, dtype=torch.float32, device=torch.device("cpu"))
    caches = [cache_kind_for(getattr(layer, "window", None), StaticKVCache)(spec)
              for layer, spec in zip(layers, specs)]
    assert [type(cache) for cache in caches] == [StaticKVCache, WindowKVCache, WindowKVCache]
    outs = [ours(ids[:, :prompt], positions=torch.arange(prompt), caches=caches)]
    for p in range(prompt, n):
        outs.append(ours(ids[:, p:p + 1], positions=torch.tensor([p]), caches=caches))
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, atol=1e-4, rtol=1e-4)
    assert caches[1].nbytes < caches[0].nbytes
