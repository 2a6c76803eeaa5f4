"""The Llama family's configs and rotary embedding against transformers' own."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import PRESETS, LlamaConfig, rope_settings
from qkv.models.configs.qwen import Qwen2Config, Qwen3Config


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rotary_embedding_matches_transformers(shared_checkpoint, kind: str) -> None:
    """cos/sin for per-row positions (llama3 scaling for llama, head_dim 24 for qwen3)."""
    folder, reference = shared_checkpoint(kind)
    model, _ = qkv.load_pretrained(folder)
    positions = torch.stack([torch.arange(0, 100), torch.arange(20, 120)])  # (2, 100)
    x = torch.zeros(2, 100, 8)
    hf_cos, hf_sin = reference.model.rotary_emb(x, positions)
    cos, sin = model.model.rotary_emb(positions)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)


def test_llama3_scaling_is_read_and_changes_low_frequencies(shared_checkpoint) -> None:
    folder, _ = shared_checkpoint("llama")
    model, _ = qkv.load_pretrained(folder)
    scaling = model.cfg.rope_scaling
    assert scaling is not None and scaling.factor == 8.0 and scaling.original_max_position_embeddings == 16
    plain = LlamaForCausalLM(LlamaConfig(**{**model.cfg.to_dict(), "rope_scaling": None}))
    scaled, unscaled = model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq
    assert bool((scaled <= unscaled).all())  # scaling only ever slows rotations down
    torch.testing.assert_close(scaled[-1], unscaled[-1] / 8.0)  # the slowest is slowed by factor


@pytest.mark.parametrize(
    ("config_class", "kind"), [(LlamaConfig, "llama"), (Qwen2Config, "qwen2"), (Qwen3Config, "qwen3")]
)
def test_from_hf_config_reads_what_transformers_writes(shared_checkpoint, config_class, kind: str) -> None:
    folder, reference = shared_checkpoint(kind)
    config = json.loads((folder / "config.json").read_text())
    cfg = config_class.from_hf_config(config)
    hf = reference.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
    )
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings and cfg.rms_norm_eps == hf.rms_norm_eps
    assert (cfg.attention_bias, cfg.qk_norm) == {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}[kind]


def test_rope_settings_read_both_config_spellings() -> None:
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert rope_settings(old) == rope_settings(new) == (500000.0, PRESETS["llama-3.2-1b"].rope_scaling)
    with pytest.raises(ValueError, match="RoPE scaling type 'yarn' is not supported"):
        rope_settings({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"head_dim": 15}, "RoPE needs an even head_dim, got 15"),
        ({"hidden_size": 66, "head_dim": None}, r"hidden_size \(66\) is not divisible by num_attention_heads \(4\)"),
        ({"vocab_size": 0}, "vocab_size must be between 1 and 16,777,216, got 0"),
        ({"attention_backend": "flash"}, "attention_backend must be one of"),
    ],
)
def test_config_validation_names_the_values(changes: dict, message: str) -> None:
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, head_dim=16)
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**base, **changes})


def test_family_configs_refuse_what_their_family_lacks() -> None:
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match="Qwen3 normalises queries and keys"):
        Qwen3Config(**base, qk_norm=False)
    with pytest.raises(ValueError, match="Qwen2 has q/k/v biases"):
        Qwen2Config(**base, attention_bias=False)
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        LlamaConfig.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="config.json lacks intermediate_size"):
        LlamaConfig.from_hf_config({k: v for k, v in base.items() if k != "intermediate_size"})


def test_kv_cache_bytes_grouped_query_vs_multi_head() -> None:
    """Sharing each key/value head among H / H_kv query heads divides the cache by that."""
    mha = LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=8))
    gqa = LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2))
    mha_bytes, gqa_bytes = (sum(StaticKVCache(spec).nbytes for spec in model.cache_specs(3, 40))
                            for model in (mha, gqa))
    # 2 layers x (keys + values) x batch 3 x heads x 40 positions x head size 8 x 4 bytes
    assert mha_bytes == 2 * 2 * 3 * 8 * 40 * 8 * 4
    assert gqa_bytes * 4 == mha_bytes
