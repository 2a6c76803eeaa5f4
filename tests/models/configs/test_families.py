"""Every family qkv reads from a Hugging Face folder, against transformers on tiny random
checkpoints that transformers builds and saves: logits, greedy tokens (cache on and off),
cached == uncached logits at every step, with prompts longer than the sliding windows so
the local layers' windows are exercised; and what each config reader makes of config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import qkv
from qkv.errors import QkvError
from qkv.runtime import DecodeSession
from qkv.models.configs import families
from tests.models.conftest import VOCAB, make_tokenizer

WINDOW = 5
PROMPT = 12  # > WINDOW: local layers see only part of the prompt
NEW_TOKENS = 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def _longrope(pairs: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.2 * i for i in range(pairs)], "long_factor": [2.0 + 0.7 * i for i in range(pairs)]}


# name -> (transformers config class, model class, config overrides)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma2-softcap-window": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0)),
    "gemma3-local-global": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi4mini-longrope-partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.75, tie_word_embeddings=True, original_max_position_embeddings=16,
        rope_parameters={**_longrope(6), "partial_rotary_factor": 0.75})),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=24)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3-nope": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(tie_word_embeddings=False)),
}


def build_reference(name: str, seed: int = 0) -> Any:
    import transformers as tf

    config_class, model_class, overrides = CASES[name]
    config = getattr(tf, config_class)(**{**COMMON, **overrides})
    config._attn_implementation = "eager"  # soft-caps and windows as the reference computes them
    torch.manual_seed(seed)
    return getattr(tf, model_class)(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, tuple[Path, Any]] = {}

    def make(name: str) -> tuple[Path, Any]:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            reference = build_reference(name)
            reference.save_pretrained(folder)
            make_tokenizer().save(str(folder / "tokenizer.json"))
            made[name] = (folder, reference)
        return made[name]

    return make


# LongRoPE switches from its short to its long factors for a sequence longer than 16 here;
# transformers' Phi-3 generate then recomputes the whole sequence once, without its cache
# (keys rotated by the short factors would be stale), which no other family does. The
# generation tests start these cases past the switch, so every step uses the long factors.
PROMPTS = {"phi4mini-longrope-partial": 20}


@pytest.fixture(params=list(CASES))
def pair(request, saved):
    folder, reference = saved(request.param)
    model, _ = qkv.load_pretrained(folder)
    return model, reference, PROMPTS.get(request.param, PROMPT)


def prompt(batch: int = 2, tokens: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(7))


def test_logits_match_transformers(pair) -> None:
    model, reference, _ = pair
    x = prompt(tokens=24)  # past the LongRoPE cases' original 16 positions: the long factors
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x).logits, rtol=0, atol=1e-4)
        short = x[:, :10]  # within them: the short factors
        torch.testing.assert_close(model(short), reference(short).logits, rtol=0, atol=1e-4)


def test_greedy_tokens_match_transformers_with_and_without_cache(pair) -> None:
    model, reference, length = pair
    x = prompt(tokens=length)
    expected = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(qkv.generate(model, x, NEW_TOKENS), expected)
    assert torch.equal(qkv.generate(model, x, NEW_TOKENS, use_cache=False), expected)


def test_cached_logits_equal_uncached_past_the_window(pair) -> None:
    model, reference, length = pair
    sequence = prompt(tokens=length + NEW_TOKENS)
    with torch.no_grad():
        full = model(sequence)
        hf_full = reference(sequence).logits
    with DecodeSession(model, batch_size=2, capacity=sequence.shape[1]) as session:
        steps = [session.prefill(sequence[:, :length])]
        steps += [session.decode(sequence[:, i]) for i in range(length, sequence.shape[1] - 1)]
    cached = torch.stack(steps, dim=1)  # (2, N, V): the logits after each of tokens length-1 ..
    torch.testing.assert_close(cached, full[:, length - 1:-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(cached, hf_full[:, length - 1:-1], rtol=0, atol=1e-4)


def test_windows_matter_past_the_window(saved) -> None:
    """The same weights without their window give other logits once the prompt is longer
    than it: the window really limits what a local query sees (and the tests above check it
    against transformers' sliding-window attention)."""
    folder, _ = saved("mistral-window")
    model, _ = qkv.load_pretrained(folder)
    x = prompt(tokens=16)
    with torch.no_grad():
        windowed = model(x)
        for layer in model.attention_layers():
            layer.window = None
        unwindowed = model(x)
    torch.testing.assert_close(windowed[:, :WINDOW], unwindowed[:, :WINDOW], rtol=0, atol=1e-5)
    assert (windowed[:, WINDOW:] - unwindowed[:, WINDOW:]).abs().max() > 1e-2


def _config(saved, name: str) -> dict[str, Any]:
    folder, _ = saved(name)
    return json.loads((folder / "config.json").read_text())


def test_gemma3_layers_read_their_windows_and_rope_bases(saved) -> None:
    spec = families.gemma3_text_spec(_config(saved, "gemma3-local-global"))
    assert spec.windows() == tuple(WINDOW if t == "sliding_attention" else None for t in LOCAL_GLOBAL)
    local, global_ = spec.layers[0], spec.layers[1]
    assert (local.rope.base, local.rope.scaling) == (10000.0, ())
    assert global_.rope.base == 1e6 and dict(global_.rope.scaling) == {"rope_type": "linear", "factor": 8.0}
    assert local.attention.qk_norm.weight_offset == 1.0 and local.attn_post_norm is not None
    assert spec.embedding_scale == 64 ** 0.5 and local.mlp.activation == "gelu_tanh"
    assert local.attention.score_scale == 256 ** -0.5  # query_pre_attn_scalar's default


def test_gemma3_reads_transformers_4_spelling() -> None:
    """rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern (4.x)."""
    config = {**COMMON, "model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 16,
              "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window": 512,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6}
    spec = families.gemma3_text_spec(config)
    assert spec.windows() == (512,) * 5 + (None,)
    assert [layer.rope.base for layer in spec.layers] == [10000.0] * 5 + [1e6]


def test_smollm3_leaves_rope_out_of_every_fourth_layer(saved) -> None:
    spec = families.smollm3_spec(_config(saved, "smollm3-nope"))
    assert [layer.rope is None for layer in spec.layers] == [False, False, False, True]


def test_phi4_mini_rotates_three_quarters_of_each_head(saved) -> None:
    spec = families.phi3_spec(_config(saved, "phi4mini-longrope-partial"))
    rope = spec.layers[0].rope
    assert rope.rotary_dim == 12 and spec.layers[0].attention.head_dim == 16
    assert dict(rope.scaling)["rope_type"] == "longrope" and spec.stacked_qkv and spec.stacked_gate_up


def test_olmo2_norms_come_after_each_block(saved) -> None:
    layer = families.olmo2_spec(_config(saved, "olmo2")).layers[0]
    assert layer.attn_norm is None and layer.mlp_norm is None
    assert layer.attn_post_norm is not None and layer.mlp_post_norm is not None
    assert layer.attention.qk_norm_over == "all"


@pytest.mark.parametrize(("name", "change", "named"), [
    ("gemma2-softcap-window", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("gemma3-local-global", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ("phi4mini-longrope-partial", {"rope_parameters": {**_longrope(5), "partial_rotary_factor": 0.75}}, "short_factor"),
    ("mistral-window", {"sliding_window": 0}, "sliding_window"),
    ("olmo2", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("smollm3-nope", {"no_rope_layers": [1, 1, 2, 0]}, "no_rope_layers"),
    ("mistral-window", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
])
def test_bad_config_values_are_refused_by_name(saved, tmp_path: Path, name: str, change: dict, named: str) -> None:
    folder, _ = saved(name)
    target = tmp_path / "bad"
    target.mkdir()
    for file in folder.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = {**_config(saved, name), **change}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(QkvError, match=named):
        qkv.load_pretrained(target)


def test_an_unknown_model_type_is_named_with_what_qkv_reads(saved, tmp_path: Path) -> None:
    folder, _ = saved("olmo2")
    config = {**_config(saved, "olmo2"), "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"]}
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QkvError, match=r"falcon_h1.*Gemma2ForCausalLM.*Olmo2ForCausalLM"):
        qkv.load_pretrained(tmp_path)


def test_a_whole_gemma3_folder_loads_its_text_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (model_type gemma3): the text model is read from
    text_config and language_model.*, the vision tower's tensors are skipped by name."""
    import transformers as tf

    text = tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 2, "head_dim": 16, "sliding_window": WINDOW})
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                             image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = tf.Gemma3ForConditionalGeneration(config).eval()
    reference.save_pretrained(tmp_path)
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    model, _ = qkv.load_pretrained(tmp_path)
    x = torch.randint(0, VOCAB - 3, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(input_ids=x).logits, rtol=0, atol=1e-4)
    assert model.spec.windows() == (WINDOW, WINDOW)


def test_every_family_describes_its_layers_for_the_native_layer_kernel(saved) -> None:
    """layer_specs() and layer_parts() hand qkv's whole-layer kernel each layer's description
    and tensors; the runtime declines only what the kernel lacks (LongRoPE here)."""
    from qkv.attention.stacking import stack_projections
    from qkv.runtime.layer_step_spec import declined

    for name in CASES:
        folder, _ = saved(name)
        model, _ = qkv.load_pretrained(folder)
        assert model.layer_parts() is None, name  # the kernel reads q, k, v and gate, up stacked
        stack_projections(model)
        parts, specs = model.layer_parts(), model.layer_specs()
        assert parts is not None and len(parts) == len(specs) == 4, name
        assert specs == model.spec.layers
        for part, spec in zip(parts, specs):
            assert (part.attn_post_norm is None) == (spec.attn_post_norm is None), name
            assert (part.inv_freq is None) == (spec.rope is None), name
        reasons = {declined(spec) for spec in specs}
        assert reasons == ({"RoPE scaling 'longrope' (the native layer has llama3's, linear, or none)"}
                           if name == "phi4mini-longrope-partial" else {None}), name
