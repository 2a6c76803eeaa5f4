"""The book's GPT model (chapter 4), which is GPT-2's architecture.

Names follow the book (tok_emb, pos_emb, trf_blocks, att, ff, norm1, norm2, final_norm,
out_head) and so does the config (vocab_size, context_length, emb_dim, n_heads, n_layers,
drop_rate, qkv_bias), so a reader of the book recognises every part. The attention `att`
is the shared `GroupedQueryAttention` with as many key/value heads as query heads (the
book's multi-head attention): its projections are q_proj, k_proj, v_proj and o_proj, the
book's W_query, W_key, W_value and out_proj (GPT-2's fused c_attn is split at load time,
qkv.models.hf_keys). Unlike the book's MultiHeadAttention it keeps no (context_length x
context_length) mask buffer: causality is passed to the kernel, and a KV cache can be
attached for generation.

Shape legend: B batch, T new tokens, S key tokens (cache included), C embedding (emb_dim),
H heads, D head size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.kernels import BACKENDS, Backend
from qkv.models.decoder import CausalDecoder
from qkv.models.hf_fields import (
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
    attention_backend: Backend = "fused"

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
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"GPTConfig attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}"
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


class LayerNorm(nn.Module):
    """Section 4.2: normalise each token's features, then scale and shift (learned)."""

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.scale, self.shift, self.eps)


class GELU(nn.Module):
    """Section 4.3: GPT-2's tanh approximation of GELU."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim), GELU(), nn.Linear(4 * cfg.emb_dim, cfg.emb_dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Section 4.5: pre-norm attention and feed-forward, each with a shortcut."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.att = GroupedQueryAttention(
            cfg.emb_dim, cfg.n_heads, qkv_bias=cfg.qkv_bias, out_bias=True,
            dropout=cfg.drop_rate, backend=cfg.attention_backend,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim, cfg.layer_norm_eps)
        self.norm2 = LayerNorm(cfg.emb_dim, cfg.layer_norm_eps)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: Tensor, *, mask: Tensor | None, positions: Tensor) -> Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x), mask=mask, positions=positions))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(CausalDecoder):
    """Section 4.6: token + position embeddings, transformer blocks, final norm, output head.

    forward(input_ids (B, T), *, positions=None, mask=None) -> logits (B, T, V).
    `positions` (T,) or (B, T) defaults to cache_length + arange(T); `mask` is a (B, S)
    key padding mask or a boolean mask broadcastable to (B, 1, T, S) for padded batches
    (see qkv.models.decoder). The output head may share its weight with tok_emb (GPT-2
    checkpoints do) or not (the book trains it separately).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = LayerNorm(cfg.emb_dim, cfg.layer_norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    def attention_layers(self) -> Iterator[GroupedQueryAttention]:
        return (block.att for block in self.trf_blocks)

    def tie_weights(self) -> None:
        """Share the output head's weight with the token embedding (as GPT-2 does)."""
        self.out_head.weight = self.tok_emb.weight

    @property
    def weights_tied(self) -> bool:
        return self.out_head.weight is self.tok_emb.weight

    def forward(
        self, input_ids: Tensor, *, positions: Tensor | None = None, mask: Tensor | None = None
    ) -> Tensor:
        positions, mask = self.call_arguments(input_ids, positions, mask)  # (T,) or (B, T); bool
        x = self.drop_emb(self.tok_emb(input_ids) + self.pos_emb(positions))  # (B, T, C)
        for block in self.trf_blocks:
            x = block(x, mask=mask, positions=positions)
        return self.out_head(self.final_norm(x))  # (B, T, V)
