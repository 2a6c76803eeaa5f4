"""Stacked projections compute what the separate layers compute."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.stacking import stack_projections, stack_linears
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.runtime.prepare import prepare_for_decoding


@pytest.mark.parametrize("bias", [False, True])
def test_a_stacked_layer_is_the_layers_outputs_side_by_side(bias: bool) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(12, n, bias=bias) for n in (8, 4, 4)]
    x = torch.randn(3, 5, 12)
    stacked = stack_linears(layers)
    torch.testing.assert_close(stacked(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_layers_of_different_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="input size"):
        stack_linears([nn.Linear(4, 2), nn.Linear(5, 2)])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_attention_and_llama_match_the_unfused_ones(qk_norm: bool) -> None:
    torch.manual_seed(0)
    attention = GroupedQueryAttention(36, 9, num_kv_heads=3, head_dim=8, qkv_bias=True, qk_norm=qk_norm).eval()
    x = torch.randn(2, 7, 36)
    fused = copy.deepcopy(attention)
    fused.stack_projections()
    assert not hasattr(fused, "k_proj") and fused.qkv_proj is not None
    torch.testing.assert_close(fused(x), attention(x))
    for got, want in zip(fused.project(x), attention.project(x)):
        torch.testing.assert_close(got, want)

    config = LlamaConfig(vocab_size=97, hidden_size=36, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 11))
    reference = model(ids)
    assert stack_projections(model) == 4  # two attention layers, two SwiGLUs
    torch.testing.assert_close(model(ids), reference)


def test_prepare_for_decoding_fuses_before_quantizing() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    prepare_for_decoding(model, precision="int8", compile=False)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    assert {"qkv_proj", "gate_up_proj"} <= names and not names & {"q_proj", "k_proj", "gate_proj"}
    assert all(type(m) is not nn.Linear for m in model.modules())  # every product quantized, fused ones too
