"""The one decoder every Hugging Face family runs on, built from its `DecoderSpec`.

Each layer is the skeleton of qkv.models.configs.layer_spec,

    x = x + post_norm_a(attention(norm_a(x)))
    x = x + post_norm_m(mlp(norm_m(x)))

with the parts its `LayerSpec` names: RMSNorms with or without Gemma's 1 + w offset, before
and/or after each sub-block; grouped-query attention with its own window, score scale,
soft-cap, q/k norm and RoPE (base, scaling, rotated fraction) or none; a gated MLP with silu
(SwiGLU) or gelu_tanh (GeGLU). Around the layers: the token embedding (scaled for Gemma), the
final norm, the output head (tied or not) and the logits' soft-cap (Gemma 2).

Modules are named as the checkpoints name them, so key maps are near-identity:
model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, q_norm, k_norm,
mlp.{gate,up,down}_proj}, model.norm, lm_head. The norms around the MLP are named as each
family names them: the norm before the MLP is `post_attention_layernorm` where attention has
no post-norm (Llama, Qwen, Mistral, Phi-3, SmolLM3) and `pre_feedforward_layernorm` where it
has one (Gemma 2/3, whose post-attention norm takes that name); the norm after the MLP is
`post_feedforward_layernorm` (Gemma, OLMo 2).

Shape legend: B batch, T new tokens, C hidden size, F feed-forward size, V vocabulary,
R rotated channels of a head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.rmsnorm import RMSNorm
from qkv.attention.rope import RotaryEmbedding
from qkv.attention.rope_scaling import scaled_rotary
from qkv.attention.stacking import stack_linears
from qkv.attention.caches.kv_cache import KVCache
from qkv.names import AttentionKernel
from qkv.models.decoder import CausalDecoder, HeadParts, LayerParts
from qkv.models.configs.decoder_spec import DecoderSpec
from qkv.models.configs.layer_spec import LayerSpec, MlpSpec, NormSpec, RopeSpec

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rms_norm(size: int, spec: NormSpec) -> RMSNorm:
    return RMSNorm(size, spec.eps, weight_offset=spec.weight_offset)


def norm_names(spec: LayerSpec) -> dict[str, str]:
    """{role: module name} for the norms the layer has (module docstring)."""
    names = {}
    if spec.attn_norm is not None:
        names["attn_norm"] = "input_layernorm"
    if spec.attn_post_norm is not None:
        names["attn_post_norm"] = "post_attention_layernorm"
    if spec.mlp_norm is not None:
        names["mlp_norm"] = "pre_feedforward_layernorm" if spec.attn_post_norm is not None else "post_attention_layernorm"
    if spec.mlp_post_norm is not None:
        names["mlp_post_norm"] = "post_feedforward_layernorm"
    return names


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): (B, T, C) -> (B, T, C) through F; SwiGLU
    with silu, GeGLU with gelu_tanh. For decoding, `stack_projections()` stacks gate_proj
    and up_proj into `gate_up_proj` (one product, the same numbers)."""

    def __init__(self, hidden_size: int, spec: MlpSpec) -> None:
        super().__init__()
        if not spec.gated:
            raise ValueError("the decoders read from config.json have gated MLPs")
        f = spec.intermediate_size
        self.activation_name = spec.activation
        self.activation = ACTIVATIONS[spec.activation]
        self.gate_proj = nn.Linear(hidden_size, f, bias=spec.bias)
        self.up_proj = nn.Linear(hidden_size, f, bias=spec.bias)
        self.down_proj = nn.Linear(f, hidden_size, bias=spec.bias)
        self.gate_up_proj: nn.Linear | None = None

    def stack_projections(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = stack_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, 2F) -> (B, T, F) x 2
        return self.down_proj(self.activation(gate) * up)


class SpecDecoderLayer(nn.Module):
    """One layer as its LayerSpec describes it (module docstring)."""

    def __init__(self, hidden_size: int, spec: LayerSpec, *, backend: AttentionKernel = "fused", dropout: float = 0.0) -> None:
        super().__init__()
        self.spec = spec
        a = spec.attention
        self.norm_names = norm_names(spec)
        for role, name in self.norm_names.items():
            setattr(self, name, rms_norm(hidden_size, getattr(spec, role)))
        qk = a.qk_norm
        self.self_attn = GroupedQueryAttention(
            hidden_size, a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
            qkv_bias=a.qkv_bias, out_bias=a.out_bias, qk_norm=qk is not None, qk_norm_over=a.qk_norm_over,
            qk_norm_offset=0.0 if qk is None else qk.weight_offset, norm_eps=1e-6 if qk is None else qk.eps,
            dropout=dropout, backend=backend, scale=a.scale, window=a.window, softcap=a.softcap,
            rotary_dim=None if spec.rope is None else spec.rope.rotary_dim,
        )
        self.mlp = GatedMLP(hidden_size, spec.mlp)

    def norm(self, role: str, x: Tensor) -> Tensor:
        name = self.norm_names.get(role)
        return x if name is None else getattr(self, name)(x)

    def forward(
        self, x: Tensor, *, cos: Tensor | None, sin: Tensor | None, mask: Tensor | None, positions: Tensor,
        cache: KVCache | None = None,
    ) -> Tensor:
        attended = self.self_attn(self.norm("attn_norm", x), cos=cos, sin=sin, mask=mask, positions=positions,
                                  cache=cache)
        x = x + self.norm("attn_post_norm", attended)
        return x + self.norm("mlp_post_norm", self.mlp(self.norm("mlp_norm", x)))


class SpecBackbone(nn.Module):
    """Embeddings, the layers, the final norm, and one RoPE module per distinct RopeSpec
    (`rotary_emb` is the first: the only one of most families)."""

    def __init__(self, spec: DecoderSpec, *, backend: AttentionKernel = "fused", dropout: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            [SpecDecoderLayer(spec.hidden_size, layer, backend=backend, dropout=dropout) for layer in spec.layers])
        self.norm = rms_norm(spec.hidden_size, spec.final_norm)
        ropes: list[RopeSpec] = []
        for layer in spec.layers:
            if layer.rope is not None and layer.rope not in ropes:
                ropes.append(layer.rope)
        self.rope_index = [None if layer.rope is None else ropes.index(layer.rope) for layer in spec.layers]
        tables = [scaled_rotary(r.rotary_dim, r.base, r.scaling_dict) for r in ropes]
        self.rotary_emb: RotaryEmbedding | None = tables[0] if tables else None
        self.extra_rotary = nn.ModuleList(tables[1:])

    def rotaries(self) -> list[RotaryEmbedding]:
        return ([] if self.rotary_emb is None else [self.rotary_emb]) + list(self.extra_rotary)  # type: ignore[list-item]


class SpecDecoder(CausalDecoder):
    """forward(input_ids (B, T), *, positions=None, mask=None) -> logits (B, T, V).

    See qkv.models.decoder for positions, masks and the cache. `spec` (also `cfg`, which
    a family's own config class may replace) is the DecoderSpec the model was built from."""

    def __init__(self, spec: DecoderSpec, *, backend: AttentionKernel = "fused", dropout: float = 0.0) -> None:
        super().__init__()
        self.spec = spec
        self.cfg: object = spec
        self.model = SpecBackbone(spec, backend=backend, dropout=dropout)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def context_length(self) -> int:
        return self.spec.context_length

    def rotary_embedding(self) -> RotaryEmbedding | None:
        """The model's RoPE when every layer rotates its whole head by the same one (what a
        cache that rotates keys itself can stand in for); else None."""
        ropes = self.spec.layers[0].rope
        uniform = all(layer.rope == ropes for layer in self.spec.layers)
        if not uniform or ropes is None or ropes.rotary_dim != self.spec.layers[0].attention.head_dim:
            return None
        return self.model.rotary_emb

    def attention_layers(self) -> Iterator[GroupedQueryAttention]:
        return (layer.self_attn for layer in self.model.layers)

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Each layer's description, for a runtime that executes descriptions (qkv.runtime)."""
        return tuple(layer.spec for layer in self.model.layers)

    def layer_parts(self) -> list[LayerParts] | None:
        """Each layer's tensors as its description names them (`layer_specs()`), for qkv's
        whole-layer kernel, or None before `stack_projections` (the kernel reads q, k, v and
        gate, up stacked). Which descriptions the kernel runs is the runtime's to say."""
        rotaries = self.model.rotaries()
        parts = []
        for layer, rope in zip(self.model.layers, self.model.rope_index):
            s, attention, mlp = layer.spec, layer.self_attn, layer.mlp
            if mlp.gate_up_proj is None or attention.qkv_proj is None:
                return None
            norms = {role: (getattr(layer, name).weight,) for role, name in layer.norm_names.items()}
            q_norm, k_norm = (getattr(attention.q_norm, "weight", None), getattr(attention.k_norm, "weight", None))
            parts.append(LayerParts(
                attn_norm=norms.get("attn_norm", ()), attention=attention, mlp_norm=norms.get("mlp_norm", ()),
                up=mlp.gate_up_proj, down=mlp.down_proj,
                attn_post_norm=norms.get("attn_post_norm"), mlp_post_norm=norms.get("mlp_post_norm"),
                q_norm=q_norm if s.attention.qk_norm is not None else None,
                k_norm=k_norm if s.attention.qk_norm is not None else None,
                inv_freq=None if rope is None else rotaries[rope].inv_freq,
            ))
        return parts

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        if self.spec.embedding_scale is not None:
            x = x * torch.tensor(self.spec.embedding_scale, dtype=x.dtype)  # in the embedding's dtype, as HF does
        return x

    def head_parts(self) -> HeadParts:
        return HeadParts(norm=self.spec.final_norm, norm_tensors=(self.model.norm.weight,), head=self.lm_head,
                         softcap=self.spec.final_softcap)

    def head(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.model.norm(x))  # (B, T, V)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(
        self, input_ids: Tensor, *, positions: Tensor | None = None, mask: Tensor | None = None,
        caches: Sequence[KVCache] | None = None, last_only: bool = False,
    ) -> Tensor:
        """Logits (B, T, V); last_only: the last position's only, (B, 1, V) (a prompt's next token)."""
        positions, mask = self.call_arguments(input_ids, positions, mask, caches)  # (T,) or (B, T); bool
        x = self.embed(input_ids, positions)  # (B, T, C)
        rope_positions = self.rope_positions(positions, caches)
        tables = [rotary(rope_positions, dtype=x.dtype) for rotary in self.model.rotaries()]  # (T, R) or (B, T, R)
        for index, (layer, rope) in enumerate(zip(self.model.layers, self.model.rope_index)):
            cos, sin = (None, None) if rope is None else tables[rope]
            x = layer(x, cos=cos, sin=sin, mask=mask, positions=positions,
                      cache=None if caches is None else caches[index])
        return self.head(x[:, -1:] if last_only else x)  # (B, T, V) or (B, 1, V)
