"""The exact split on real learned weights: SmolLM2-135M (30 layers, 9 query heads sharing 3
key/value heads, RoPE), at every layer, against the model's own scores and transformers' eager
attentions on the same GGUF file; the sink split and a key patch on the same model."""

from __future__ import annotations

import pytest
import torch

from qkv.trace.explain.attribution import TOLERANCE, attribute_recorded, record_forward
from qkv.trace.explain.patching import feature_mask, patch, projections, replace_at
from qkv.trace.explain.sink import explain_sinks

pytestmark = [pytest.mark.xdist_group("smollm2"), pytest.mark.slow]

TEXT = "Anna lives in Paris. The capital of France is"


@pytest.fixture
def eager_reference(hf_smollm2_model):
    previous = hf_smollm2_model.config._attn_implementation
    hf_smollm2_model.set_attn_implementation("eager")
    yield hf_smollm2_model
    hf_smollm2_model.set_attn_implementation(previous)


def test_smollm2_splits_add_up_at_every_layer(smollm2_model, eager_reference):
    model, tokenizer = smollm2_model
    ids = torch.tensor([tokenizer.encode(TEXT).ids])
    t = ids.shape[1]
    record = record_forward(model, ids, layers=range(30), queries=[t - 1])
    with torch.no_grad():
        expected = eager_reference(ids, output_attentions=True).attentions
    for layer in range(30):
        head = layer % 9
        result = attribute_recorded(record, layer=layer, head=head, query=t - 1)
        trace = record.traces[layer]
        size = trace.q[0, head, 0].double().norm() * trace.keys[0, head].double().norm(dim=-1)  # (S,)
        error = (result.pairs.sum((1, 2)) - result.scores.double()).abs()
        assert bool((error <= TOLERANCE * size.clamp_min(1.0)).all()), (layer, float(error.max()))
        assert float((result.bands.sum(1) - result.scores.double()).abs().max()) <= TOLERANCE * float(size.max())
        weights = torch.softmax(result.pairs.sum((1, 2)) * result.scale, dim=0)
        torch.testing.assert_close(weights, expected[layer][0, head, t - 1].double(), atol=2e-5, rtol=1e-4)
        assert result.group_heads == [3 * (head // 3) + g for g in range(3)]


def test_smollm2_sink_and_a_key_patch(smollm2_model):
    model, tokenizer = smollm2_model
    ids = torch.tensor([tokenizer.encode(TEXT).ids])
    sinks = explain_sinks(model, ids, count=2)
    assert len(sinks) == 2 and all(s.sink_mass > 0.5 for s in sinks)
    for sink in sinks:
        assert float(sink.pairs.sum()) == pytest.approx(sink.score, rel=1e-5, abs=1e-4)
    attention = list(model.attention_layers())[5]
    own = projections(model, ids, 5)
    same = patch(model, ids, layer=5, observe=(5, 0, ids.shape[1] - 1),
                 edit=replace_at(torch.tensor([3]), own[3:4], feature_mask(attention, None)))
    assert same.kl == 0.0 and torch.equal(same.weights_before, same.weights_after)
