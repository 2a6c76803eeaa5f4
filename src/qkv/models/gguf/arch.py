"""What each GGUF architecture qkv reads is in Hugging Face terms: its config reader
(qkv.models.gguf.config), its tensor names, and the converter's transforms to undo.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes one `general.architecture` per family
and renames every tensor (`blk.0.attn_q.weight`); on the way it changes some of them, and
reading the file back must undo that:

- llama and smollm3: q/k rows of each head reordered for interleaved RoPE (undone by
  `qkv.models.gguf.checkpoint.unpermute_rows`);
- gemma2 and gemma3: 1 added to every RMSNorm weight (Hugging Face keeps w, computes x*(1+w));
- gpt2: the Conv1D matrices (c_attn, c_proj, c_fc) stored as (out, in), not Conv1D's (in, out).

Phi-3 keeps its stacked `qkv_proj` and `gate_up_proj` as they are in Hugging Face, and Qwen,
Gemma and OLMo keep rotate-half RoPE order, so those need no transform.

Shape legend: C embedding, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qkv.errors import QkvError
from qkv.models.gguf.config import (
    LLAMA3_ROPE_TENSOR, LONGROPE_TENSORS, Metadata, gemma2, gemma3, gpt2, llama, olmo2, phi3, qwen2, qwen3, smollm3,
)

# ----------------------------------------------------------------------------- tensor names

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_LAYER = {
    **_LLAMA_LAYER, **_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_OLMO2_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("attn_norm", "ffn_norm")}, **_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate then up, fused as in Hugging Face
    "ffn_down": "mlp.down_proj",
}
_GPT2_LAYER = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_DECODER_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT2_GLOBAL = {
    "token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
    "output": "lm_head",
}


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture: its config reader, its names, and the converter's transforms to undo."""

    name: str
    read_config: Callable[[Metadata], dict[str, Any]]
    layer_names: dict[str, str]  # GGUF module in blk.{i} -> Hugging Face module in the layer
    global_names: dict[str, str] = field(default_factory=lambda: dict(_DECODER_GLOBAL))
    layer_prefix: str = "model.layers"
    suffixes: tuple[str, ...] = ("weight",)  # ".weight", and ".bias" where the family has biases
    permuted_qk: bool = False  # q/k rows in llama.cpp's interleaved-RoPE order
    norm_shift: float = 0.0  # added to every *norm.weight by the converter
    transposed: frozenset[str] = frozenset()  # GGUF modules whose 2-D weights are stored (out, in) for a Conv1D (in, out)
    settings: frozenset[str] = frozenset()  # tensors read into the config (Phi-3's LongRoPE factors), not weights

    def weights(self, tensors: Any) -> list[Any]:
        """The file's tensors that are weights (all but `settings`), in the file's order."""
        return [t for t in tensors if t.name not in self.settings]

    def hf_name(self, gguf_name: str) -> str | None:
        """Hugging Face name of a GGUF tensor, None when this architecture has no such tensor."""
        module, dot, suffix = gguf_name.rpartition(".")
        if not dot or suffix not in self.suffixes:
            return None
        if module in self.global_names:
            return f"{self.global_names[module]}.{suffix}"
        parts = module.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.layer_names:
            return f"{self.layer_prefix}.{int(parts[1])}.{self.layer_names[parts[2]]}.{suffix}"
        return None

    def layer_of(self, hf_name: str) -> int | None:
        if not hf_name.startswith(self.layer_prefix + "."):
            return None
        return int(hf_name[len(self.layer_prefix) + 1:].split(".", 1)[0])

    def is_transposed(self, gguf_name: str, ndim: int) -> bool:
        module = gguf_name.rpartition(".")[0].rpartition(".")[2]
        return ndim == 2 and gguf_name.endswith(".weight") and module in self.transposed

    def is_shifted_norm(self, gguf_name: str) -> bool:
        return self.norm_shift != 0.0 and gguf_name.endswith("norm.weight")


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("llama", llama, _LLAMA_LAYER, permuted_qk=True, settings=frozenset({LLAMA3_ROPE_TENSOR})),
        Architecture("qwen2", qwen2, _LLAMA_LAYER, suffixes=("weight", "bias")),
        Architecture("qwen3", qwen3, {**_LLAMA_LAYER, **_QK_NORMS}),
        Architecture("gemma2", gemma2, _GEMMA_LAYER, norm_shift=1.0),
        Architecture("gemma3", gemma3, _GEMMA_LAYER, norm_shift=1.0),
        Architecture("phi3", phi3, _PHI3_LAYER, settings=frozenset(LONGROPE_TENSORS)),
        Architecture("olmo2", olmo2, _OLMO2_LAYER),
        Architecture("smollm3", smollm3, _LLAMA_LAYER, permuted_qk=True),
        Architecture(
            "gpt2", gpt2, _GPT2_LAYER, global_names=_GPT2_GLOBAL, layer_prefix="transformer.h",
            suffixes=("weight", "bias"), transposed=frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"}),
        ),
    )
}


def architecture(reader: Any, path: Path) -> Architecture:
    """The file's `general.architecture`; one qkv does not read -> QkvError naming it and the ones it does."""
    value = reader.fields.get("general.architecture")
    try:
        name = value.contents() if value is not None else None
    except Exception:
        name = None
    if name not in ARCHITECTURES:
        raise QkvError(
            f"{path} holds a {str(name)[:40]!r} model; qkv reads GGUF files of these architectures: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def read_config(reader: Any, path: Path) -> dict[str, Any]:
    """The model's hyperparameters as the family's config.json dict, each value checked."""
    arch = architecture(reader, path)
    meta = Metadata(reader, path, arch.name)
    _refuse_experts(meta)
    return arch.read_config(meta)


def _refuse_experts(meta: Metadata) -> None:
    """A mixture-of-experts file (Mixtral is written as `llama`, with `llama.expert_count` and
    `blk.N.ffn_*_exps` tensors) is named as such, before its expert tensors would be refused
    one by one as unknown: qkv's decoders have one feed-forward network per layer."""
    experts = meta.raw(f"{meta.arch}.expert_count")
    counted = isinstance(experts, int) and not isinstance(experts, bool) and experts > 0
    expert_tensors = sorted(n for n in meta.tensor_names if "_exps." in n or "_shexp." in n or ".ffn_gate_inp." in n)
    if not counted and not expert_tensors:
        return
    if counted:
        used = meta.raw(f"{meta.arch}.expert_used_count")
        per_token = f", {used} used per token" if isinstance(used, int) and not isinstance(used, bool) else ""
        what = f"{experts} experts{per_token}: {meta.arch}.expert_count"
    else:
        what = f"tensor {expert_tensors[0][:80]!r}"
    raise meta.refuse(
        f"is a mixture-of-experts model ({what}); qkv's decoders have one feed-forward network "
        "per layer and do not run mixture-of-experts models"
    )
