"""Write a transformers model to GGUF the way llama.cpp's `convert_hf_to_gguf.py` does (f32).

The tests cannot run llama.cpp's converter (CI has no llama.cpp checkout), so this follows
it: the same metadata keys per architecture, the tensor names from the `gguf` package's own
name map (the one the converter uses), and the converter's transforms: q/k rows permuted for
llama and smollm3, 1 added to Gemma's norm weights, GPT-2's Conv1D matrices transposed. Its
output was compared once by hand with the converter's on the same models (metadata and every
tensor equal; see benchmarks/HISTORY.md, issue 24, GGUF architectures). The tokenizer is the
byte-level BPE of the test's `tokenizers.Tokenizer`, as in tests/models/gguf/test_checkpoint.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3, "olmo2": gguf.MODEL_ARCH.OLMO2, "smollm3": gguf.MODEL_ARCH.SMOLLM3,
    "gpt2": gguf.MODEL_ARCH.GPT2,
}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's LlamaModel.permute: rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer: gguf.GGUFWriter, model_type: str, c: Any) -> None:
    if model_type == "gpt2":
        writer.add_block_count(c.n_layer)
        writer.add_context_length(c.n_ctx if hasattr(c, "n_ctx") else c.n_positions)
        writer.add_embedding_length(c.n_embd)
        writer.add_feed_forward_length(4 * c.n_embd)
        writer.add_head_count(c.n_head)
        writer.add_layer_norm_eps(c.layer_norm_epsilon)
        return
    rope = c.rope_parameters
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if model_type == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        head = c.hidden_size // c.num_attention_heads
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads)
        assert head % 2 == 0
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(c.sliding_window or 0)
        if rope.get("rope_type") == "longrope":  # generate_extra_tensors: the factors follow as tensors
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            attn = math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
            for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG), ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
                writer.add_tensor(gguf.TENSOR_NAMES[tensor] + ".weight", np.array(rope[key], dtype=np.float32))
        return
    if model_type != "gemma2":  # Gemma2Model writes no RoPE base
        writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if model_type == "gemma3_text":
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":  # TextModel.set_gguf_parameters
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if model_type in ("mistral", "qwen3", "gemma2", "gemma3_text") or (model_type == "llama" and getattr(c, "head_dim", None)):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if model_type == "llama" and rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        orig, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                                   rope["high_freq_factor"], rope["factor"])
        divisors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < orig / high:
                divisors.append(1)
            elif wavelen > orig / low:
                divisors.append(factor)
            else:
                smooth = (orig / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", torch.tensor(divisors, dtype=torch.float32).numpy())
    if model_type in ("llama", "mistral", "smollm3"):
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(c.head_dim if getattr(c, "head_dim", None) else c.hidden_size // c.num_attention_heads)
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
    if model_type == "gemma3_text":
        if c.final_logit_softcapping:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)


def _tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, c: Any) -> None:
    spec = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    writer.add_token_types([1] * len(tokens))
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if isinstance(getattr(c, key, None), int):
            add(getattr(c, key))


def write_gguf(path: Path, model: Any, tokenizer: Any, *, extra: dict[str, Any] | None = None,
               block_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """`model` (a transformers causal LM) as llama.cpp's converter writes it in f32.
    extra: more `{arch}.`-less metadata keys -> int values (e.g. a sliding window).
    block_type: every matrix of whole 32-blocks quantized to it (gguf.quants), as llama-quantize does."""
    c = model.config
    model_type = c.model_type
    arch = GGUF_ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, model_type, c)
    for key, value in (extra or {}).items():
        writer.add_uint32(f"{writer.arch}.{key}", value)
    _tokenizer(writer, tokenizer, c)
    layers = c.n_layer if model_type == "gpt2" else c.num_hidden_layers
    names = gguf.get_tensor_name_map(arch, layers)
    tied = c.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and (tied or model_type.startswith("gemma")):
            continue  # the converter skips a tied (and every Gemma) head
        module, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(module)
        assert gguf_name is not None, f"no GGUF name for {name}"
        w = tensor.detach().float()
        if model_type in ("llama", "mistral", "smollm3") and module.endswith(("q_proj", "k_proj")) and suffix == "weight":
            heads = c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads
            w = _permute(w, heads)
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        if model_type == "gpt2" and suffix == "weight" and module.endswith(("c_attn", "c_proj", "c_fc")):
            w = w.T
        values = np.ascontiguousarray(w.numpy())
        if block_type is not None and values.ndim == 2 and values.shape[1] % 32 == 0:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(values, block_type), raw_dtype=block_type)
            continue
        writer.add_tensor(f"{gguf_name}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
