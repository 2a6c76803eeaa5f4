"""The book's GPT configuration (GPT_CONFIG_124M, section 4.1) and its Hugging Face
GPT-2 config.json mapping. Torch-free, so `qkv train --help` and the presets answer
without importing torch; the model itself is qkv.models.gpt2.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from qkv.names import ATTENTION_KERNELS, AttentionKernel
from qkv.models.configs.fields import (
    MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, check_float, check_int, get_bool, get_float, get_int, get_str,
)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False
    layer_norm_eps: float = 1e-5
    attention_backend: AttentionKernel = "fused"

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, maximum=MAX_VOCAB)
        check_int("context_length", self.context_length, maximum=MAX_POSITIONS)
        check_int("emb_dim", self.emb_dim)
        check_int("n_heads", self.n_heads, maximum=self.emb_dim)
        check_int("n_layers", self.n_layers, maximum=MAX_LAYERS)
        if self.emb_dim % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig emb_dim ({self.emb_dim}) must be divisible by n_heads ({self.n_heads})"
            )
        check_float("drop_rate", self.drop_rate, minimum=0.0, maximum=0.999)
        check_float("layer_norm_eps", self.layer_norm_eps, positive=True, maximum=1.0)
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"GPTConfig qkv_bias must be true or false, got {self.qkv_bias!r}")
        if self.attention_backend not in ATTENTION_KERNELS:
            raise ValueError(
                f"GPTConfig attention_backend must be one of {ATTENTION_KERNELS}, got {self.attention_backend!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.n_heads

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> GPTConfig:
        """Read a Hugging Face GPT-2 config.json. GPT-2 always has q/k/v biases; a folder
        written by qkv.save_pretrained from a bias-free book model says "qkv_bias": false."""
        missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer") if k not in config]
        if missing:
            raise ValueError(f"GPT-2 config.json lacks {', '.join(missing)}")
        activation = get_str(config, "activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(
                f"GPT-2 activation_function {activation!r} is not supported (qkv uses the tanh GELU, "
                "'gelu_new')"
            )
        emb_dim = get_int(config, "n_embd")
        n_inner = get_int(config, "n_inner", None)
        if n_inner is not None and n_inner != 4 * emb_dim:
            raise ValueError(f"GPT-2 n_inner={n_inner} is not supported (qkv uses 4 * n_embd)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if get_bool(config, flag, False):
                raise ValueError(f"GPT-2 option {flag}=true is not supported")
        if not get_bool(config, "scale_attn_weights", True):
            raise ValueError("GPT-2 option scale_attn_weights=false is not supported")
        return cls(
            vocab_size=get_int(config, "vocab_size", maximum=MAX_VOCAB),
            context_length=get_int(config, "n_positions", maximum=MAX_POSITIONS),
            emb_dim=emb_dim,
            n_heads=get_int(config, "n_head"),
            n_layers=get_int(config, "n_layer", maximum=MAX_LAYERS),
            drop_rate=get_float(config, "resid_pdrop", 0.1, minimum=0.0, maximum=0.999),
            qkv_bias=get_bool(config, "qkv_bias", True),
            layer_norm_eps=get_float(config, "layer_norm_epsilon", 1e-5, positive=True, maximum=1.0),
        )

    def to_hf_config(self, *, tie_word_embeddings: bool) -> dict[str, Any]:
        """The GPT2LMHeadModel config.json for this model (transformers reads it)."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.context_length,
            "n_embd": self.emb_dim,
            "n_head": self.n_heads,
            "n_layer": self.n_layers,
            "n_inner": None,
            "activation_function": "gelu_new",
            "resid_pdrop": self.drop_rate,
            "embd_pdrop": self.drop_rate,
            "attn_pdrop": self.drop_rate,
            "layer_norm_epsilon": self.layer_norm_eps,
            "scale_attn_weights": True,
            "tie_word_embeddings": tie_word_embeddings,
            "qkv_bias": self.qkv_bias,
        }


# The book's GPT_CONFIG_124M (section 4.1); drop_rate as the book sets it.
GPT_CONFIG_124M = GPTConfig(
    vocab_size=50257, context_length=1024, emb_dim=768, n_heads=12, n_layers=12,
    drop_rate=0.1, qkv_bias=False,
)
