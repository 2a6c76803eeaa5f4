"""What wrote the residual stream: every source's real contribution, recorded by forward hooks.

A pre-norm decoder's residual stream at a position is a plain sum: the token embedding
(plus GPT-2's learned position embedding), and for every earlier block its attention output
and its MLP output. The attention output is itself a sum over heads, because the output
projection is linear: o_proj(concat) = sum_h concat_h @ W_o[:, h]^T + b_o. So recording
the embeddings' outputs, the input of every o_proj (each head's context, side by side) and
every MLP's output gives each source exactly as the model computed it.

    layout = residual_layout(model)            # the model's parts, by family (isinstance)
    with recording_sources(model, layout, layers=[3]) as record:
        model(input_ids)
    record.sources(3)                          # what wrote block 3's attention input

Also recorded for the chosen target blocks: the real residual entering the attention norm
(its per-token scale comes from it), and the inputs of q_norm / k_norm (Qwen3's per-head
scales). Nothing in the model is changed; only batch 1 is recorded.

Shape legend: T tokens, C embedding, H query heads, D head size, n sources.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.rmsnorm import RMSNorm
from qkv.errors import QkvError
from qkv.models.configs.decoder_spec import DecoderSpec


@dataclass(frozen=True)
class Block:
    """One pre-norm block: x + attention(attn_norm(x)), then + mlp(norm(x))."""

    attn_norm: nn.Module  # RMSNorm, or GPT-2's LayerNorm (scale, shift, eps)
    attention: GroupedQueryAttention
    mlp: nn.Module


@dataclass(frozen=True)
class ResidualLayout:
    embeddings: list[tuple[str, nn.Module]]  # ("embed", tok_emb), ("pos", pos_emb)
    blocks: list[Block]
    final_norm: nn.Module  # before the output head


def residual_layout(model: nn.Module) -> ResidualLayout:
    """The parts that write the residual stream, for the decoder families qkv builds."""
    from qkv.models.gpt2 import GPT2Decoder
    from qkv.models.spec_decoder import SpecDecoder

    if isinstance(model, GPT2Decoder):
        return ResidualLayout([("embed", model.tok_emb), ("pos", model.pos_emb)],
                              [Block(b.norm1, b.att, b.ff) for b in model.trf_blocks], model.final_norm)
    if isinstance(model, SpecDecoder):
        problem = unattributable(model.spec)
        if problem:
            raise QkvError(f"score attribution follows pre-norm decoders with one RoPE (Llama, Qwen, SmolLM2); "
                           f"this {model.spec.model_type} model {problem}")
        return ResidualLayout([("embed", model.model.embed_tokens)],
                              [Block(l.input_layernorm, l.self_attn, l.mlp) for l in model.model.layers],
                              model.model.norm)
    raise QkvError(f"score attribution needs a decoder qkv builds (GPT-2, Llama, Qwen); "
                   f"{type(model).__name__} is not one")


def unattributable(spec: DecoderSpec) -> str | None:
    """What keeps a decoder's scores from being the plain sums attribution takes apart, or None."""
    layers = spec.layers
    reasons = [
        (spec.embedding_scale is not None, "scales its embeddings"),
        (any(l.attn_post_norm is not None or l.mlp_post_norm is not None for l in layers), "has norms after its blocks"),
        (any(l.attn_norm is None or l.mlp_norm is None for l in layers), "lacks a norm before a block"),
        (any(n is not None and n.weight_offset for l in layers
             for n in (l.attn_norm, l.mlp_norm, l.attention.qk_norm)), "has (1 + w) norm weights"),
        (any(l.attention.softcap is not None for l in layers), "soft-caps its scores"),
        (any(l.attention.scale is not None for l in layers), "scales its scores by its own factor"),
        (any(l.attention.window is not None for l in layers), "has sliding-window layers"),
        (any(l.attention.qk_norm_over != "head" for l in layers), "normalises queries and keys over all heads"),
        (len({l.rope for l in layers}) > 1, "has layers with different RoPE (or none)"),
        (any(l.rope is not None and l.rope.rotary_dim != l.attention.head_dim for l in layers),
         "rotates only part of each head"),
    ]
    return next((why for bad, why in reasons if bad), None)


def norm_kind(norm: nn.Module) -> str:
    """'rms' (Llama, Qwen) or 'layer' (GPT-2: mean shift, scale and shift)."""
    if isinstance(norm, RMSNorm):
        return "rms"
    if hasattr(norm, "scale") and hasattr(norm, "shift"):
        return "layer"
    raise QkvError(f"{type(norm).__name__} is a norm score attribution does not know")


def linear_weight(layer: nn.Module) -> Tensor:
    """(out, in) weight of a linear layer; a quantized one shows the weights it stands for."""
    weight = layer.dequantized() if hasattr(layer, "dequantized") else layer.weight
    return weight.detach()


@dataclass
class SourceRecord:
    """The sources of one forward, batch item 0. Per block: concat (T, H*D) into o_proj, the
    attention module's output (T, C) and the MLP's output (T, C); per target block the real
    residual (T, C) entering its attention norm and the q/k-norm inputs (T, H, D)."""

    layout: ResidualLayout
    embeddings: dict[str, Tensor] = field(default_factory=dict)  # name -> (T, C)
    concat: dict[int, Tensor] = field(default_factory=dict)  # block -> (T, H*D)
    attention_out: dict[int, Tensor] = field(default_factory=dict)  # block -> (T, C)
    mlp_out: dict[int, Tensor] = field(default_factory=dict)  # block -> (T, C)
    residual: dict[int, Tensor] = field(default_factory=dict)  # target block -> (T, C)
    q_norm_in: dict[int, Tensor] = field(default_factory=dict)  # target block -> (T, H, D)
    k_norm_in: dict[int, Tensor] = field(default_factory=dict)  # target block -> (T, H_kv, D)
    _float64: dict[tuple[str, int], Tensor] = field(default_factory=dict, repr=False)

    def o_weight64(self, block: int) -> Tensor:
        """(C, H, D) block's o_proj weight in float64, per head (made once per record)."""
        key = ("o_weight", block)
        if key not in self._float64:
            attention = self.layout.blocks[block].attention
            self._float64[key] = _o_proj_weight(attention).double().view(-1, attention.num_heads, attention.head_dim)
        return self._float64[key]

    def concat64(self, block: int) -> Tensor:
        """(T, H*D) the heads' contexts entering block's o_proj, in float64 (made once)."""
        key = ("concat", block)
        if key not in self._float64:
            self._float64[key] = self.concat[block].double()
        return self._float64[key]

    def head_outputs(self, block: int) -> Tensor:
        """(T, H, C) each head's real contribution to the residual (o_proj without bias)."""
        attention = self.layout.blocks[block].attention
        h, d = attention.num_heads, attention.head_dim
        concat = self.concat64(block)  # (T, H*D)
        w_o = self.o_weight64(block)  # (C, H, D)
        return torch.einsum("thd,chd->thc", concat.view(concat.shape[0], h, d), w_o)

    def o_bias(self, block: int) -> Tensor | None:
        bias = self.layout.blocks[block].attention.o_proj.bias
        return None if bias is None else bias.detach()


def _o_proj_weight(attention: GroupedQueryAttention) -> Tensor:
    return linear_weight(attention.o_proj)  # (C, H*D)


def _first(value) -> Tensor:
    return (value[0] if isinstance(value, tuple) else value).detach()


@contextlib.contextmanager
def recording_sources(model: nn.Module, layout: ResidualLayout,
                      layers: Sequence[int]) -> Iterator[SourceRecord]:
    """Hooks that record every source while the `with` block runs one forward (batch 1)."""
    record = SourceRecord(layout)
    targets = set(layers)
    last = max(targets) if targets else -1
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def keep(store: dict, key, pre: bool = False):
        def hook(module, args, output=None):
            value = _first(args) if pre else _first(output)
            if value.dim() == 2:  # GPT-2's position embedding of (T,) positions: (T, C)
                store[key] = value
                return
            if value.shape[0] != 1:
                raise QkvError("score attribution records one text at a time (batch 1)")
            store[key] = value[0]

        return hook

    try:
        for name, module in layout.embeddings:
            handles.append(module.register_forward_hook(keep(record.embeddings, name)))
        for i, block in enumerate(layout.blocks[: last + 1]):
            attention = block.attention
            handles.append(attention.o_proj.register_forward_pre_hook(keep(record.concat, i, pre=True)))
            handles.append(attention.register_forward_hook(keep(record.attention_out, i)))
            handles.append(block.mlp.register_forward_hook(keep(record.mlp_out, i)))
            if i in targets:
                handles.append(block.attn_norm.register_forward_pre_hook(keep(record.residual, i, pre=True)))
                if not isinstance(attention.q_norm, nn.Identity):
                    handles.append(attention.q_norm.register_forward_pre_hook(keep(record.q_norm_in, i, pre=True)))
                    handles.append(attention.k_norm.register_forward_pre_hook(keep(record.k_norm_in, i, pre=True)))
        yield record
    finally:
        for handle in handles:
            handle.remove()
