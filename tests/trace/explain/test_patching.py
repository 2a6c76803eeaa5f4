"""Key and value patching (qkv.trace.explain.patching) on tiny random decoders: a patch with the
key's own value changes nothing bit for bit; a donor key gives transformers' logits under
the same patch; removing a source from the keys moves the scores by exactly that source's
attributed terms; a sweep's batched patches are the single patches."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.errors import QkvError
from qkv.trace.explain.attribution import attribute
from qkv.trace.explain.patching import (feature_mask, editing_projection, patch, patch_sweep, projections,
                                remove_share, replace_at, source_share)
from qkv.trace.record.recorder import trace

T = 8


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(3)
    return torch.randint(0, 96, (1, T))


@pytest.fixture(scope="module")
def donor_ids(ids):
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 17) % 96  # one token differs: its key (and later ones) change
    return other


def _load(tiny_decoder, kind: str):
    folder, reference = tiny_decoder(kind)
    model, _ = qkv.load_pretrained(folder)
    return model, reference


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_patching_a_key_or_value_with_its_own_changes_nothing_bit_for_bit(tiny_decoder, ids, kind, fused):
    model, _ = _load(tiny_decoder, "qwen3")
    if fused:
        for attention in model.attention_layers():
            attention.stack_projections()
    with torch.no_grad():
        plain = model(ids)
    for layer in (0, 1):
        attention = list(model.attention_layers())[layer]
        own = projections(model, ids, layer, kind)  # (T, F)
        edit = replace_at(torch.tensor([4]), own[4:5], feature_mask(attention, None))
        with torch.no_grad(), editing_projection(attention, kind, edit):
            patched = model(ids)
        assert torch.equal(patched, plain)
    outcome = patch(model, ids, layer=1, edit=edit, kind=kind, observe=(1, 2, T - 1))
    assert outcome.kl == 0.0 and outcome.layer_change == 0.0
    assert torch.equal(outcome.weights_before, outcome.weights_after)


def _hf_key_hook(reference, family: str, layer: int, position: int, donor: torch.Tensor):
    """The same patch on transformers' own modules: its key projection's output at one position."""
    if family == "gpt2":
        c_attn = reference.transformer.h[layer].attn.c_attn
        width = reference.config.n_embd

        def hook(module, args, output):
            out = output.clone()
            out[0, position, width:2 * width] = donor
            return out

        return c_attn.register_forward_hook(hook)

    def hook(module, args, output):
        out = output.clone()
        out[0, position] = donor
        return out

    return reference.model.layers[layer].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_a_donor_key_gives_transformers_logits_under_the_same_patch(tiny_decoder, ids, donor_ids, family):
    model, reference = _load(tiny_decoder, family)
    layer, position = 1, 3
    donor = projections(model, donor_ids, layer, "key")[position]  # (F,)
    attention = list(model.attention_layers())[layer]
    edit = replace_at(torch.tensor([position]), donor[None], feature_mask(attention, None))
    with torch.no_grad(), editing_projection(attention, "key", edit):
        patched = model(ids)
    handle = _hf_key_hook(reference, family, layer, position, donor)
    try:
        with torch.no_grad():
            expected = reference(ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(patched, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(patched, model(ids), atol=1e-4)  # the patch did something


@pytest.mark.parametrize("family,source", [("llama", "L0.H1"), ("llama", "embed"), ("gpt2", "L0.mlp"),
                                           ("gpt2", "norm shift"), ("qwen2", "k bias"), ("llama", "L0.attn")])
def test_removing_a_source_from_the_keys_moves_each_score_by_its_attributed_terms(tiny_decoder, ids, family, source):
    model, _ = _load(tiny_decoder, family)
    layer, head, query = 1, 1, T - 1
    before = attribute(model, ids, layer=layer, head=head, query=query)
    attention = list(model.attention_layers())[layer]
    share = source_share(model, ids, layer, source)  # (T, F)
    with editing_projection(attention, "key", remove_share(share, feature_mask(attention, None))):
        after = trace(model, ids, layer=layer, head=head, query=query).layers[0].scores[0, 0, 0]  # (S,)
    if source == "L0.attn":
        removed = sum(before.pairs[:, :, before.key_sources.index(f"L0.H{h}")].sum(1) for h in range(4))
    else:
        removed = before.pairs[:, :, before.key_sources.index(source)].sum(1)  # (S,)
    torch.testing.assert_close(after.double(), before.scores.double() - removed, atol=1e-5, rtol=1e-5)


def test_a_sweep_is_the_single_patches_and_a_same_prompt_donor_changes_nothing(tiny_decoder, ids, donor_ids):
    model, _ = _load(tiny_decoder, "llama")
    sweep = patch_sweep(model, ids, layers=[0, 1], donor_ids=donor_ids)
    assert [row.layer for row in sweep.rows] == [0, 1] and all(len(r.kl) == T for r in sweep.rows)
    donor = projections(model, donor_ids, 1, "key")
    attention = list(model.attention_layers())[1]
    for position in (3, 5):
        single = patch(model, ids, layer=1, observe=(1, 0, T - 1), edit=replace_at(
            torch.tensor([position]), donor[position:position + 1], feature_mask(attention, None)))
        assert sweep.rows[1].kl[position] == pytest.approx(single.kl, rel=1e-3, abs=1e-7)
    assert max(sweep.rows[1].kl[:3]) < 1e-9  # before the changed token the donor's keys are the text's
    assert sweep.rows[1].kl[3] > 1e-6
    assert sweep.strongest(1)[0][2] == max(max(r.kl) for r in sweep.rows)
    same = patch_sweep(model, ids, layers=[1], donor_ids=ids, kind="value")
    assert max(same.rows[0].kl) < 1e-9 and same.donor == "prompt"
    assert patch_sweep(model, ids, layers=[1]).donor == "mean"


def test_bad_patches_are_named(tiny_decoder, ids):
    model, _ = _load(tiny_decoder, "llama")
    with pytest.raises(QkvError, match="same length"):
        patch_sweep(model, ids, layers=[0], donor_ids=ids[:, :5])
    with pytest.raises(QkvError, match="not a source of layer 1"):
        source_share(model, ids, 1, "L1.mlp")
    with pytest.raises(QkvError, match="key/value head 5"):
        feature_mask(list(model.attention_layers())[0], [5])
