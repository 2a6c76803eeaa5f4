"""The Llama family's config (Llama 3.x, SmolLM2, TinyLlama): a frozen dataclass, named
presets, and `from_hf_config` reading a Hugging Face config.json.

Hugging Face config.json files name RoPE settings two ways: `rope_theta` + `rope_scaling`
(transformers 4.x) or one `rope_parameters` dict (transformers 5); `rope_settings` reads both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from qkv.names import ATTENTION_KERNELS, AttentionKernel
from qkv.attention.rope import Llama3RopeScaling
from qkv.models.configs.fields import (
    MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, check_float, check_int, get_bool, get_dict, get_float, get_int, get_str,
)


def rope_settings(config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from a config.json; unsupported scaling types raise ValueError."""
    params = get_dict(config, "rope_parameters")
    theta = get_float(params, "rope_theta", config.get("rope_theta", 10000.0), positive=True)
    scaling = get_dict(config, "rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"RoPE scaling type {str(rope_type)[:40]!r} is not supported (qkv knows 'default', 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"llama3 RoPE scaling lacks {', '.join(missing)}")
    return theta, Llama3RopeScaling(
        factor=get_float(scaling, "factor", positive=True),
        low_freq_factor=get_float(scaling, "low_freq_factor", positive=True),
        high_freq_factor=get_float(scaling, "high_freq_factor", positive=True),
        original_max_position_embeddings=get_int(scaling, "original_max_position_embeddings", maximum=MAX_POSITIONS),
    )


def require(config: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: as many as query heads (multi-head)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys
    attention_dropout: float = 0.0
    attention_backend: AttentionKernel = "fused"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            check_int("hidden_size", self.hidden_size)
            check_int("num_attention_heads", self.num_attention_heads, maximum=self.hidden_size)
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_int("vocab_size", self.vocab_size, maximum=MAX_VOCAB)
        check_int("hidden_size", self.hidden_size)
        check_int("intermediate_size", self.intermediate_size)
        check_int("num_hidden_layers", self.num_hidden_layers, maximum=MAX_LAYERS)
        check_int("num_attention_heads", self.num_attention_heads, maximum=self.hidden_size)
        check_int("num_key_value_heads", self.num_key_value_heads, maximum=self.num_attention_heads)
        check_int("head_dim", self.head_dim)
        check_int("max_position_embeddings", self.max_position_embeddings, maximum=MAX_POSITIONS)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        check_float("rms_norm_eps", self.rms_norm_eps, positive=True, maximum=1.0)
        check_float("rope_theta", self.rope_theta, positive=True)
        check_float("attention_dropout", self.attention_dropout, minimum=0.0, maximum=0.999)
        flags = ("tie_word_embeddings", "attention_bias", "attention_out_bias", "mlp_bias", "qk_norm")
        odd = [f for f in flags if not isinstance(getattr(self, f), bool)]
        if odd:
            raise ValueError(f"{', '.join(odd)} must be true or false")
        if self.attention_backend not in ATTENTION_KERNELS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_KERNELS}, got {self.attention_backend!r}")

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def common_hf_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The fields every Llama-like config.json spells the same way."""
        require(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        act = get_str(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act[:40]!r} is not supported (qkv's SwiGLU uses 'silu')")
        theta, scaling = rope_settings(config)
        return dict(
            vocab_size=get_int(config, "vocab_size", maximum=MAX_VOCAB),
            hidden_size=get_int(config, "hidden_size"),
            intermediate_size=get_int(config, "intermediate_size"),
            num_hidden_layers=get_int(config, "num_hidden_layers", maximum=MAX_LAYERS),
            num_attention_heads=get_int(config, "num_attention_heads"),
            num_key_value_heads=get_int(config, "num_key_value_heads", None),
            head_dim=get_int(config, "head_dim", None),
            max_position_embeddings=get_int(config, "max_position_embeddings", 2048, maximum=MAX_POSITIONS),
            rms_norm_eps=get_float(config, "rms_norm_eps", 1e-6, positive=True, maximum=1.0),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=get_bool(config, "tie_word_embeddings", False),
            attention_dropout=get_float(config, "attention_dropout", 0.0, minimum=0.0, maximum=0.999),
        )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LlamaConfig:
        """A LlamaForCausalLM config.json (model_type "llama")."""
        bias = get_bool(config, "attention_bias", False)
        return cls(
            **cls.common_hf_fields(config),
            attention_bias=bias,
            attention_out_bias=bias,
            mlp_bias=get_bool(config, "mlp_bias", False),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The LlamaForCausalLM config.json for this config."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        if self.attention_bias != self.attention_out_bias:
            raise ValueError("a Llama config.json has one attention_bias for q/k/v and o_proj alike")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": rope if self.rope_scaling is not None else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "attention_dropout": self.attention_dropout,
        }


# Published shapes of real checkpoints (their config.json files).
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)
TINYLLAMA_1_1B = LlamaConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)
LLAMA_3_2_1B = LlamaConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling=Llama3RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
)
PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": SMOLLM2_135M,
    "tinyllama-1.1b": TINYLLAMA_1_1B,
    "llama-3.2-1b": LLAMA_3_2_1B,
}
