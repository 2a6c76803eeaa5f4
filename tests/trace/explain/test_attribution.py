"""The exact split of attention scores (qkv.trace.explain.attribution) on tiny random GPT-2, Llama
(grouped-query, Llama-3 RoPE), Qwen2 (q/k/v biases) and Qwen3 (q/k-norm) decoders loaded by
qkv.load_pretrained, at every layer: the terms add up to the model's scores, their softmax is
transformers' eager attention on the same weights, and the sources add up to transformers'
hidden states."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
from qkv.errors import QkvError
from qkv.trace.explain.attribution import attribute, attribute_recorded, record_forward
from qkv.trace.record.recorder import TraceMismatchError

T = 9
KINDS = ["gpt2", "llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(7)
    return torch.randint(0, 96, (1, T))


@pytest.fixture(scope="module")
def recorded(tiny_decoder, ids):
    """kind -> (qkv model, ForwardRecord of every layer and query, transformers outputs)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            folder, reference = tiny_decoder(kind)
            model, _ = qkv.load_pretrained(folder)
            with torch.no_grad():
                expected = reference(ids, output_attentions=True, output_hidden_states=True)
            made[kind] = (model, record_forward(model, ids, layers=[0, 1]), expected)
        return made[kind]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_every_split_adds_up_to_the_score_and_softmaxes_to_transformers_weights(kind, recorded):
    model, record, expected = recorded(kind)
    for layer in (0, 1):
        for head in range(4):
            for query in (0, T // 2, T - 1):  # whole rows; any other row: the property test below
                result = attribute_recorded(record, layer=layer, head=head, query=query)
                assert result.keys == list(range(query + 1))
                sums = result.pairs.sum((1, 2))  # (S,)
                torch.testing.assert_close(sums, result.scores.double(), atol=1e-5, rtol=0)
                weights = torch.softmax(sums * result.scale, dim=0)
                reference = expected.attentions[layer][0, head, query, : query + 1].double()
                torch.testing.assert_close(weights, reference, atol=1e-5, rtol=1e-4)
                if result.bands is not None:
                    torch.testing.assert_close(result.bands.sum(1), result.scores.double(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_sources_add_up_to_transformers_hidden_states(kind, recorded):
    """What the split is built from is complete: the recorded sources sum to the residual
    stream transformers reports entering each layer."""
    model, record, expected = recorded(kind)
    src = record.sources
    for layer in (0, 1):
        total = sum(e.double() for e in src.embeddings.values())  # (T, C)
        for l in range(layer):
            total = total + src.head_outputs(l).sum(1) + src.mlp_out[l].double()
            if src.o_bias(l) is not None:
                total = total + src.o_bias(l).double()
        torch.testing.assert_close(total, expected.hidden_states[layer][0].double(), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), layer=st.integers(0, 1), head=st.integers(0, 3),
       query=st.integers(0, T - 1), data=st.data())
def test_splits_of_any_selection_agree_with_the_whole_row(recorded, kind, layer, head, query, data):
    model, record, _ = recorded(kind)
    keys = data.draw(st.lists(st.integers(0, query), min_size=1, max_size=4, unique=True))
    part = attribute_recorded(record, layer=layer, head=head, query=query, keys=keys)
    whole = attribute_recorded(record, layer=layer, head=head, query=query)
    torch.testing.assert_close(part.pairs, whole.pairs[keys])
    for key in keys:
        total = float(part.scores[part.slot(key)])
        assert float(part.query_totals(key).sum()) == pytest.approx(total, abs=1e-5)
        assert float(part.key_totals(key).sum()) == pytest.approx(total, abs=1e-5)
        _, _, coarse = part.coarse(key)
        assert float(coarse.sum()) == pytest.approx(total, abs=1e-5)
        largest = part.top_pairs(key, 3)
        terms = part.pairs[part.slot(key)].abs().flatten().sort(descending=True).values
        assert [abs(t) for _, _, t in largest] == pytest.approx(terms[:3].tolist())
        assert 0.0 < part.top_share(key, 3) <= 1.0 + 1e-12


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rope_pairs_turn_by_the_distance_and_not_at_all_at_distance_zero(kind, recorded):
    model, record, _ = recorded(kind)
    result = attribute_recorded(record, layer=1, head=2, query=5)
    diagonal = result.slot(5)  # query and key at one position: no turn between them
    torch.testing.assert_close(result.bands[diagonal], result.bands_unrotated[diagonal])
    assert torch.all(result.angles[diagonal] == 0)
    inv_freq = model.rotary_embedding().inv_freq.double()
    torch.testing.assert_close(result.angles[result.slot(1)], 4 * inv_freq)
    torch.testing.assert_close(result.wavelengths, 2 * torch.pi / inv_freq)
    assert not torch.allclose(result.bands[result.slot(0)], result.bands_unrotated[result.slot(0)])


def test_gpt2_has_no_rope_pairs_and_its_layernorm_shift_is_a_source(recorded):
    _, record, _ = recorded("gpt2")
    result = attribute_recorded(record, layer=1, head=0, query=4)
    assert result.bands is None and result.wavelengths is None
    assert result.query_sources[:2] == ["embed", "pos"]
    assert "norm shift" in result.query_sources and result.query_sources[-1] == "q bias"
    assert result.key_sources[-1] == "k bias"


def test_grouped_query_heads_share_the_key_and_each_scores_it(recorded, ids):
    model, record, expected = recorded("llama")
    result = attribute_recorded(record, layer=1, head=3, query=6)
    assert (result.kv_head, result.group_heads) == (1, [2, 3])
    torch.testing.assert_close(result.group_scores[1], result.scores)
    for g, head in enumerate(result.group_heads):
        torch.testing.assert_close(result.group_weights[g].double(),
                                   expected.attentions[1][0, head, 6, :7].double(), atol=1e-5, rtol=1e-4)


def test_a_source_that_does_not_add_up_is_refused(tiny_decoder, ids):
    folder, _ = tiny_decoder("llama")
    model, _ = qkv.load_pretrained(folder)
    record = record_forward(model, ids, layers=[1])
    record.sources.mlp_out[0] = record.sources.mlp_out[0] + 0.01  # no longer what the model computed
    with pytest.raises(TraceMismatchError, match="not exact"):
        attribute_recorded(record, layer=1, head=0, query=T - 1)


def test_one_call_attribute_matches_the_recorded_forward_and_bad_selections_are_named(recorded, ids):
    model, record, _ = recorded("qwen2")
    once = attribute(model, ids, layer=-1, head=1, query=T - 1, keys=[0, 3])
    torch.testing.assert_close(once.pairs, attribute_recorded(record, layer=1, head=1, query=T - 1,
                                                              keys=[0, 3]).pairs, atol=1e-5, rtol=0)
    with pytest.raises(QkvError, match="comes after the query"):
        attribute(model, ids, layer=0, head=0, query=2, keys=[5])
    with pytest.raises(QkvError, match="head 9 is out of range"):
        attribute_recorded(record, layer=0, head=9, query=1)
    json_row = once.to_json(top=2)["keys"][1]
    assert json_row["position"] == 4 and len(json_row["top_pairs"]) == 2
    assert json_row["sum_of_terms"] == pytest.approx(json_row["score"], abs=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_the_sink_split_is_the_mean_of_the_exact_splits_of_key_zero(tiny_decoder, ids, kind):
    from qkv.trace.explain.sink import explain_sinks, sink_heads

    folder, reference = tiny_decoder(kind)
    model, _ = qkv.load_pretrained(folder)
    with torch.no_grad():
        attentions = reference(ids, output_attentions=True).attentions
    heads = sink_heads(model, ids, 2)
    masses = sorted(((float(attentions[l][0, h, 1:, 0].mean()), l, h) for l in (0, 1) for h in range(4)),
                    reverse=True)
    assert [(l, h) for _, l, h in masses[:2]] == [(l, h) for l, h, _ in heads]
    (sink,) = explain_sinks(model, ids, heads=[(1, 2)])
    rows = [attribute(model, ids, layer=1, head=2, query=q, keys=[0]) for q in range(1, T)]
    torch.testing.assert_close(sink.pairs, torch.stack([r.pairs[0] for r in rows]).mean(0))
    assert sink.score == pytest.approx(float(torch.stack([r.scores[0] for r in rows]).double().mean()), abs=1e-5)
    assert sink.sink_mass == pytest.approx(masses[[(l, h) for _, l, h in masses].index((1, 2))][0], abs=1e-5)
    assert sum(t for _, t in sink.key_totals()) == pytest.approx(sink.score, abs=1e-5)


def test_jupyter_shows_the_split_as_escaped_html(recorded, ids):
    model, _, _ = recorded("llama")
    tokens = [f"<t{i}>" for i in range(T)]
    result = attribute(model, ids, layer=1, head=0, query=T - 1, tokens=tokens)
    page = result._repr_html_()
    assert "&lt;t8&gt;" in page and "<t8>" not in page
    q, k, term = result.top_pairs(T - 1, 1)[0]
    assert f"<td>{q}</td><td>{k}</td><td>{term:.4f}</td>" in page
    bare = attribute(model, ids, layer=1, head=0, query=T - 1)._repr_html_()
    assert "Why query 9 looks at key 9" in bare
