"""The trace and its analyses on real learned weights: SmolLM2-135M (30 layers, 9 query
heads sharing 3 key/value heads, RoPE), against transformers' eager attentions on the
same GGUF file. Uses the session's shared models (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.trace.explain.analysis import analyse

pytestmark = [pytest.mark.xdist_group("smollm2"), pytest.mark.slow]


@pytest.fixture
def eager_reference(hf_smollm2_model):
    previous = hf_smollm2_model.config._attn_implementation
    hf_smollm2_model.set_attn_implementation("eager")  # attentions as weights, same outputs
    yield hf_smollm2_model
    hf_smollm2_model.set_attn_implementation(previous)


def test_smollm2_trace_and_analyses_match_transformers(smollm2_model, eager_reference):
    model, tokenizer = smollm2_model
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. The capital of Italy is").ids])
    recorded = qkv.trace(model, ids, layer=[3, 20])
    with torch.no_grad():
        expected = eager_reference(ids, output_attentions=True).attentions
    for layer in recorded.layers:
        assert (layer.num_heads, layer.num_kv_heads, layer.rope) == (9, 3, True)
        torch.testing.assert_close(layer.weights, expected[layer.index], atol=2e-5, rtol=1e-4)
        result = analyse(layer, head=4, query=ids.shape[1] - 1)
        for head in range(9):  # attention sink: the mean weight on the first token
            reference = float(expected[layer.index][0, head, 1:, 0].mean())
            assert result["sink_share"][str(head)] == pytest.approx(reference, abs=1e-5)
        assert [g["query_heads"] for g in result["kv_groups"]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        assert result["rope"]["largest_spread_at_equal_distance"] < 1e-3 * max(
            abs(s) for s in result["rope"]["score_by_distance"].values())
        assert len(result["key_norms"]) == ids.shape[1]
