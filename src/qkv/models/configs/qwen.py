"""Qwen2 and Qwen3 configs. Both run on the Llama model class (qkv.models.llama): Qwen2 adds
biases to the q/k/v projections (not o_proj); Qwen3 normalises each query and key head
with RMSNorm and often has a head size that is not hidden/heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.models.configs.fields import get_bool
from qkv.models.configs.llama import LlamaConfig


def _no_sliding_window(config: dict[str, Any]) -> None:
    if get_bool(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported (qkv attends over every key)")


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    attention_bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.attention_bias or self.attention_out_bias or self.qk_norm:
            raise ValueError(
                "Qwen2 has q/k/v biases, no o_proj bias and no q/k norm; got "
                f"attention_bias={self.attention_bias}, attention_out_bias={self.attention_out_bias}, "
                f"qk_norm={self.qk_norm}"
            )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Qwen2Config:
        """A Qwen2ForCausalLM config.json (model_type "qwen2")."""
        _no_sliding_window(config)
        return cls(**cls.common_hf_fields(config))

    def to_hf_config(self) -> dict[str, Any]:
        hf = LlamaConfig.to_hf_config(LlamaConfig(**{**self.to_dict(), "attention_bias": False}))
        del hf["attention_bias"], hf["mlp_bias"]
        return {**hf, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.qk_norm:
            raise ValueError("Qwen3 normalises queries and keys: qk_norm must be True")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Qwen3Config:
        """A Qwen3ForCausalLM config.json (model_type "qwen3")."""
        _no_sliding_window(config)
        bias = get_bool(config, "attention_bias", False)
        return cls(**cls.common_hf_fields(config), attention_bias=bias, attention_out_bias=bias)

    def to_hf_config(self) -> dict[str, Any]:
        hf = LlamaConfig.to_hf_config(LlamaConfig(**{**self.to_dict(), "qk_norm": False}))
        del hf["mlp_bias"]
        return {**hf, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}


# Published shapes of real checkpoints (their config.json files).
QWEN2_5_0_5B = Qwen2Config(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
)
QWEN3_0_6B = Qwen3Config(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
)
PRESETS: dict[str, LlamaConfig] = {"qwen2.5-0.5b": QWEN2_5_0_5B, "qwen3-0.6b": QWEN3_0_6B}
