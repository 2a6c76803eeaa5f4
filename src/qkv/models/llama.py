"""The Llama family of decoders (Llama 3.x, SmolLM2, TinyLlama) and its Qwen2/Qwen3 kin.

One block: RMSNorm -> grouped-query attention with RoPE -> shortcut, RMSNorm -> SwiGLU
feed-forward -> shortcut. The families differ only in attention options, which are
constructor arguments of GroupedQueryAttention (q/k/v bias for Qwen2, per-head q/k RMSNorm
and a head size that is not hidden/heads for Qwen3), so one model class serves all three;
each family has its own config class (qkv.models.llama_config / qkv.models.qwen).

Modules are named like the Hugging Face checkpoints (model.embed_tokens,
model.layers.N.self_attn.q_proj, input_layernorm, post_attention_layernorm,
mlp.gate_proj/up_proj/down_proj, model.norm, lm_head), so loading is an identity key map.

Shape legend: B batch, T new tokens, S key tokens (cache included), C hidden size,
F feed-forward size, D head size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.kv_cache import KVCache
from qkv.attention.rmsnorm import RMSNorm
from qkv.attention.rope import RotaryEmbedding
from qkv.attention.stacking import stack_linears
from qkv.models.decoder import CausalDecoder, LayerParts
from qkv.models.llama_config import LlamaConfig


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): (B, T, C) -> (B, T, C) through F.
    For decoding, `fuse_projections()` stacks gate_proj and up_proj into `gate_up_proj`."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """One product for gate and up (same numbers): see qkv.attention.stacking."""
        if self.gate_up_proj is None:
            self.gate_up_proj = stack_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, 2F) -> (B, T, F) x 2
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            out_bias=cfg.attention_out_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.rms_norm_eps,
            dropout=cfg.attention_dropout,
            backend=cfg.attention_backend,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, x: Tensor, *, cos: Tensor, sin: Tensor, mask: Tensor | None, positions: Tensor,
        cache: KVCache | None = None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos=cos, sin=sin, mask=mask, positions=positions,
                               cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """Embeddings, the decoder layers, the final norm and the rotary embedding."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, theta=cfg.rope_theta, scaling=cfg.rope_scaling)


class LlamaForCausalLM(CausalDecoder):
    """forward(input_ids (B, T), *, positions=None, mask=None) -> logits (B, T, V).

    See qkv.models.decoder for positions, masks and the cache. With
    cfg.tie_word_embeddings the output head shares the token embedding's weight.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    def rotary_embedding(self) -> RotaryEmbedding:
        return self.model.rotary_emb

    def attention_layers(self) -> Iterator[GroupedQueryAttention]:
        return (layer.self_attn for layer in self.model.layers)

    def layer_parts(self) -> list[LayerParts] | None:
        parts = []
        for layer in self.model.layers:
            if layer.mlp.gate_up_proj is None:  # the fused kernel reads gate and up stacked
                return None
            parts.append(LayerParts(
                attn_norm=(layer.input_layernorm.weight,), attention=layer.self_attn,
                mlp_norm=(layer.post_attention_layernorm.weight,), up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj, activation="silu_gated", eps=layer.input_layernorm.eps,
            ))
        return parts

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)  # (B, T, C)

    def head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(x))  # (B, T, V)

    def forward(
        self, input_ids: Tensor, *, positions: Tensor | None = None, mask: Tensor | None = None,
        caches: Sequence[KVCache] | None = None,
    ) -> Tensor:
        positions, mask = self.call_arguments(input_ids, positions, mask, caches)  # (T,) or (B, T); bool
        x = self.embed(input_ids, positions)  # (B, T, C)
        cos, sin = self.model.rotary_emb(self.rope_positions(positions, caches), dtype=x.dtype)  # (T, D) or (B, T, D)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos=cos, sin=sin, mask=mask, positions=positions,
                      cache=None if caches is None else caches[index])
        return self.head(x)  # (B, T, V)
