"""The Llama family of decoders (Llama 3.x, SmolLM2, TinyLlama) and its Qwen2/Qwen3 kin.

One block: RMSNorm -> grouped-query attention with RoPE -> shortcut, RMSNorm -> SwiGLU
feed-forward -> shortcut. The families differ only in attention options (q/k/v bias for
Qwen2, per-head q/k RMSNorm and a head size that is not hidden/heads for Qwen3), so all
three are the generic decoder (qkv.models.spec_decoder) built from the layer description
their config reads as (`qkv.models.configs.families.llama_decoder_spec`); each family keeps its own
config class (qkv.models.configs.llama / qkv.models.configs.qwen), which `cfg` holds.

Modules are named like the Hugging Face checkpoints (model.embed_tokens,
model.layers.N.self_attn.q_proj, input_layernorm, post_attention_layernorm,
mlp.gate_proj/up_proj/down_proj, model.norm, lm_head), so loading is an identity key map.

Shape legend: B batch, T new tokens, V vocabulary.
"""

from __future__ import annotations

from qkv.models.configs.families import llama_decoder_spec
from qkv.models.configs.llama import LlamaConfig
from qkv.models.spec_decoder import SpecDecoder


class LlamaForCausalLM(SpecDecoder):
    """forward(input_ids (B, T), *, positions=None, mask=None) -> logits (B, T, V).

    See qkv.models.decoder for positions, masks and the cache. With
    cfg.tie_word_embeddings the output head shares the token embedding's weight.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(llama_decoder_spec(cfg), backend=cfg.attention_backend, dropout=cfg.attention_dropout)
        self.cfg: LlamaConfig = cfg
