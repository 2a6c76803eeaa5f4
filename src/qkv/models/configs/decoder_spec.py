"""A whole decoder described once: what lies around the layers, plus one `LayerSpec` each.

    logits = softcap(lm_head(final_norm(layers(embed(ids) * embedding_scale))))

A family's config reader (qkv.models.configs.families) turns a config.json into a `DecoderSpec`;
`qkv.models.spec_decoder.SpecDecoder` builds the modules from it, the key maps
(qkv.models.key_maps.spec) derive every checkpoint tensor's name and shape from it, and
backends that run whole layers read its `layers`.

Shape legend: V vocabulary, C hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qkv.models.configs.fields import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, check_int
from qkv.models.configs.layer_spec import LayerSpec, NormSpec


@dataclass(frozen=True)
class DecoderSpec:
    """The decoder around its layers (module docstring).

    embedding_scale multiplies the token embeddings, in their dtype (Gemma: sqrt(C)).
    final_softcap: logits become cap * tanh(logits / cap) (Gemma 2). model_type names the
    family the spec was read for (messages, and the key map's fused-tensor layout:
    `stacked_qkv` / `stacked_gate_up` say the checkpoint stores q/k/v and gate/up stacked, Phi-3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    context_length: int
    final_norm: NormSpec = field(default_factory=NormSpec)
    embedding_scale: float | None = None
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    stacked_qkv: bool = False
    stacked_gate_up: bool = False

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, maximum=MAX_VOCAB)
        check_int("hidden_size", self.hidden_size)
        check_int("num_hidden_layers", len(self.layers), maximum=MAX_LAYERS)
        check_int("max_position_embeddings", self.context_length, maximum=MAX_POSITIONS)
        if self.embedding_scale is not None and not (self.embedding_scale > 0 and math.isfinite(self.embedding_scale)):
            raise ValueError(f"embedding_scale must be a positive number, got {self.embedding_scale}")
        if self.final_softcap is not None and not (self.final_softcap > 0 and math.isfinite(self.final_softcap)):
            raise ValueError(f"final_logit_softcapping must be positive, got {self.final_softcap}")
        for index, layer in enumerate(self.layers):
            norms = (layer.attn_norm, layer.attn_post_norm, layer.mlp_norm, layer.mlp_post_norm, layer.attention.qk_norm)
            if any(n is not None and n.kind != "rms" for n in norms):
                raise ValueError(f"layer {index}: the decoders read from config.json use RMSNorm only")
            if layer.attention.sinks:
                raise ValueError(f"layer {index}: learned attention sinks are not run by qkv's decoders yet")
        if self.final_norm.kind != "rms":
            raise ValueError("the decoders read from config.json use RMSNorm only")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers)

    @property
    def max_position_embeddings(self) -> int:
        return self.context_length

    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global)."""
        return tuple(layer.attention.window for layer in self.layers)
