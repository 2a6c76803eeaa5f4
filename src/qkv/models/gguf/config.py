"""GGUF metadata -> the config.json dict of each family that qkv reads from GGUF.

llama.cpp's converter writes the hyperparameters under the architecture's prefix
(`gemma3.attention.sliding_window`, ...), and leaves out what llama.cpp fixes per
architecture: Gemma 2's alternating and Gemma 3's five-local-one-global layer pattern, Gemma
3's local RoPE base (10000 unless `rope.freq_base_swa` says otherwise), SmolLM3's NoPE on
every fourth layer, Gemma's query scale (the head size, except for the 27B models). Each
reader here puts those back, so the dict equals what the family's own config.json says
(transformers builds the same config from it). Every value is checked before it is used.

Shape legend: V vocabulary, C embedding, F feed-forward size, H query heads, H_kv kv heads,
D head size, L layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.models.configs.fields import (
    MAX_DIM, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MISSING, check_float, check_int, is_int,
)

# ----------------------------------------------------------------------------- metadata


class Metadata:
    """Typed, checked access to one file's `{arch}.*` keys (errors name the file and key)."""

    def __init__(self, reader: Any, path: Path, arch: str) -> None:
        self.reader, self.path, self.arch = reader, path, arch
        self.tensor_names = {t.name for t in reader.tensors}

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.reader.fields.get(key)
        if value is None:
            return default
        try:
            return value.contents()
        except Exception as error:  # the reader's own view of a malformed field
            raise QkvError(f"metadata key {key!r} cannot be read ({type(error).__name__})") from None

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.reader.fields

    def int(self, name: str, default: Any = MISSING, *, minimum: int = 1, maximum: int = MAX_DIM) -> int:
        key = f"{self.arch}.{name}"
        value = self.raw(key)
        if value is None:
            if default is MISSING:
                raise QkvError(f"{self.path} lacks the metadata key {key!r}; the file was not written for llama.cpp's {self.arch} loader")
            value = default
        try:
            return check_int(key, value, minimum=minimum, maximum=maximum)
        except ValueError as error:
            raise QkvError(f"{self.path}: {error}") from None

    def layer_int(self, name: str, default: Any = MISSING, *, maximum: int = MAX_DIM) -> int:
        """An integer llama.cpp also reads as one value per layer (head counts, the feed-forward
        size: some converters write an array of block_count entries). qkv's decoders have one
        value for every layer, so an array of equal entries is that value and one whose
        entries differ is refused, naming them."""
        key = f"{self.arch}.{name}"
        value = self.raw(key)
        if not isinstance(value, list):
            return self.int(name, default, maximum=maximum)
        layers = self.int("block_count", maximum=MAX_LAYERS)
        if len(value) != layers or not all(is_int(v) for v in value):
            raise self.refuse(f"has {key} as an array of {len(value)} entries, not {layers} integers (one per layer)")
        if len(set(value)) > 1:
            shown = ", ".join(str(v) for v in value[:8]) + (", ..." if len(value) > 8 else "")
            raise self.refuse(f"has {key} that differs across its layers ({shown}); qkv's decoders "
                              f"have one {name.rsplit('.', 1)[-1]} for every layer")
        try:
            return check_int(key, value[0], maximum=maximum)
        except ValueError as error:
            raise QkvError(f"{self.path}: {error}") from None

    def float(self, name: str, default: float | None, *, positive: bool = True) -> float | None:
        key = f"{self.arch}.{name}"
        value = self.raw(key, default)
        if value is None:
            return None
        try:
            return check_float(key, value, positive=positive)
        except ValueError as error:
            raise QkvError(f"{self.path}: {error}") from None

    def token_id(self, key: str, count: int) -> int | None:
        value = self.raw(key)
        if value is None:
            return None
        if not is_int(value) or not 0 <= value < count:
            raise QkvError(f"{self.path}: {key} is {str(value)[:40]}, not a token id between 0 and {count - 1}")
        return value

    def refuse(self, what: str) -> QkvError:
        return QkvError(f"{self.path} ({self.arch}) {what}")


# ----------------------------------------------------------------------------- config parts


def _vocab_size(meta: Metadata) -> int:
    """`{arch}.vocab_size`, else the embedding's rows (Gemma 3's converter drops unused
    rows), else the tokenizer's length."""
    if meta.has("vocab_size"):
        return meta.int("vocab_size", maximum=MAX_VOCAB)
    for tensor in meta.reader.tensors:
        if tensor.name == "token_embd.weight" and len(tensor.shape) == 2:
            return check_int("token_embd.weight rows", int(tensor.shape[1]), maximum=MAX_VOCAB)
    tokens = meta.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise meta.refuse("states no vocabulary size and holds no tokenizer")
    count = tokens.count if hasattr(tokens, "count") else len(tokens.data)  # qkv's header reader, or gguf's
    return check_int("tokenizer.ggml.tokens", count, maximum=MAX_VOCAB)


def _attention_sizes(meta: Metadata, hidden: int) -> tuple[int, int, int]:
    """(H, H_kv, D); D from `attention.key_length` (Gemma, Qwen3), else C / H."""
    heads = meta.layer_int("attention.head_count", maximum=hidden)
    kv_heads = meta.layer_int("attention.head_count_kv", heads, maximum=heads)
    if not meta.has("attention.key_length") and hidden % heads != 0:
        raise meta.refuse(f"embedding_length {hidden} is not divisible by head_count {heads}")
    if heads % kv_heads != 0:
        raise meta.refuse(f"has {heads} query heads, not a multiple of its {kv_heads} key/value heads")
    head_dim = meta.int("attention.key_length", hidden // heads)
    value_dim = meta.int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise meta.refuse(f"has key_length {head_dim} and value_length {value_dim}; qkv needs them equal")
    return heads, kv_heads, head_dim


def _no_rope_scaling(meta: Metadata) -> None:
    scaling = meta.raw(f"{meta.arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise meta.refuse(f"uses RoPE scaling {str(scaling)[:40]!r}, which qkv does not read from GGUF")
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if name in meta.tensor_names:
            raise meta.refuse(f"carries per-frequency RoPE factors ({name}), which qkv does not read from GGUF")


def _whole_head_rope(meta: Metadata, head_dim: int) -> None:
    rope_dim = meta.int("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise meta.refuse(f"rotates {rope_dim} of {head_dim} head dimensions; only phi3 files rotate part of a head")


def _tokens(meta: Metadata, vocab: int) -> dict[str, Any]:
    ids = {
        "bos_token_id": meta.token_id("tokenizer.ggml.bos_token_id", vocab),
        "eos_token_id": meta.token_id("tokenizer.ggml.eos_token_id", vocab),
    }
    pad = meta.token_id("tokenizer.ggml.padding_token_id", vocab)
    if pad is not None:
        ids["pad_token_id"] = pad
    return ids


def _decoder_common(meta: Metadata) -> dict[str, Any]:
    """The fields every llama-like family spells the same way in config.json."""
    hidden = meta.int("embedding_length")
    heads, kv_heads, head_dim = _attention_sizes(meta, hidden)
    vocab = _vocab_size(meta)
    theta = meta.float("rope.freq_base", 10000.0)
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.layer_int("feed_forward_length"),
        "num_hidden_layers": meta.int("block_count", maximum=MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": meta.int("context_length", 2048, maximum=MAX_POSITIONS),
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        **_tokens(meta, vocab),
    }


def _window_pattern(meta: Metadata, layers: int, period: int) -> list[bool]:
    """Which layers are sliding-window ones: `attention.sliding_window_pattern` as one bool a
    layer or as a period n (the last of every n layers global), else llama.cpp's default for
    the architecture (`period`)."""
    pattern = meta.raw(f"{meta.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) or p in (0, 1) for p in pattern):
            raise meta.refuse(f"has a sliding_window_pattern of {len(pattern)} entries for {layers} layers")
        return [bool(p) for p in pattern]
    if pattern is not None:
        period = meta.int("attention.sliding_window_pattern", minimum=0, maximum=MAX_LAYERS)
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _layer_types(sliding: list[bool]) -> list[str]:
    return ["sliding_attention" if s else "full_attention" for s in sliding]


# ----------------------------------------------------------------------------- one reader per family


LLAMA3_ROPE_TENSOR = "rope_freqs.weight"


def _llama3_rope(meta: Metadata, head_dim: int, theta: float) -> dict[str, Any]:
    """Llama 3.1-3.3's RoPE scaling from `rope_freqs.weight`, the per-frequency divisors the
    converter computes from it (no scaling key is written).

    Each of the D/2 frequencies f (wavelength 2*pi/f) is divided by 1 above the band
    [orig/high, orig/low], by `factor` below it, and in between by 1/((1-s)/factor + s) with
    s = orig/wavelength * 1/(high-low) - low/(high-low), a line in 1/wavelength. `factor` is
    the largest divisor; the line, fitted to the in-band divisors, gives orig/(high-low) and
    low/(high-low), which fix RoPE; with low = 1 (every Llama 3's value) they give orig and
    high. The result must reproduce every divisor, else the file is refused.
    """
    import numpy as np

    tensor = next(t for t in meta.reader.tensors if t.name == LLAMA3_ROPE_TENSOR)
    count = head_dim // 2
    if tensor.tensor_type.name != "F32" or int(tensor.n_elements) != count:
        raise meta.refuse(f"has {LLAMA3_ROPE_TENSOR} of {int(tensor.n_elements)} {tensor.tensor_type.name} values, not {count} F32 ones")
    divisors = np.asarray(tensor.data, dtype=np.float32).reshape(-1).astype(np.float64)
    refusal = meta.refuse(f"has {LLAMA3_ROPE_TENSOR} factors that are not Llama 3's RoPE scaling, the one qkv reads")
    if not np.all(np.isfinite(divisors)) or not np.all(divisors >= 1.0):
        raise refusal
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    wavelengths = 2 * np.pi / freqs.astype(np.float64)
    factor = float(divisors.max())
    band = (divisors > 1.0) & (divisors < factor)
    if factor <= 1.0 or band.sum() < 2:
        raise refusal
    smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelengths[band], smooth, 1)  # s = a / wavelength - b
    a, b = float(slope), float(-intercept)  # a = orig / (high - low), b = low / (high - low)
    if a <= 0 or b <= 0:
        raise refusal
    original, high = int(round(a / b)), round(1.0 + 1.0 / b, 4)  # low = 1
    if not 1 <= original <= MAX_POSITIONS or high <= 1.0:
        raise refusal
    rebuilt = []
    for w in wavelengths:  # the converter's formula, from the recovered settings
        s = (original / w - 1.0) / (high - 1.0)
        rebuilt.append(1.0 if w < original / high else factor if w > original else 1 / ((1 - s) / factor + s))
    if not np.allclose(np.float32(rebuilt), divisors, rtol=1e-5, atol=0):
        raise refusal
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def llama(meta: Metadata) -> dict[str, Any]:
    """llama (Llama 1-3 without rope_freqs, TinyLlama, SmolLM 1/2, Mistral): a Mistral file is
    arch llama; when it states a sliding window it becomes a MistralForCausalLM config."""
    config = _decoder_common(meta)
    _whole_head_rope(meta, config["head_dim"])
    if LLAMA3_ROPE_TENSOR in meta.tensor_names and meta.raw("llama.rope.scaling.type") in (None, "none"):
        config["rope_parameters"] = _llama3_rope(meta, config["head_dim"], config["rope_theta"])
    else:
        _no_rope_scaling(meta)
    window = meta.int("attention.sliding_window", 0, minimum=0, maximum=MAX_POSITIONS)
    common = {"hidden_act": "silu", "attention_dropout": 0.0, **config}
    if window:
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **common, "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "attention_bias": False, "mlp_bias": False}


def _implied_head_dim(config: dict[str, Any]) -> dict[str, Any]:
    """Drop head_dim where the family's config.json has none because it is C / H (Qwen2, SmolLM3)."""
    if config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]:
        del config["head_dim"]
    return config


def qwen2(meta: Metadata) -> dict[str, Any]:
    config = _implied_head_dim(_decoder_common(meta))
    _whole_head_rope(meta, config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]))
    _no_rope_scaling(meta)
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", **config,
            "use_sliding_window": False, "sliding_window": None}


def qwen3(meta: Metadata) -> dict[str, Any]:
    config = _decoder_common(meta)
    _whole_head_rope(meta, config["head_dim"])
    _no_rope_scaling(meta)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", **config,
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None}


def _gemma_scale(config: dict[str, Any], big_layers: int) -> int:
    """Gemma's query_pre_attn_scalar: the head size, except for the 27B models (told apart by
    their layer count, as llama.cpp does), which scale by C / H."""
    if config["num_hidden_layers"] == big_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def gemma2(meta: Metadata) -> dict[str, Any]:
    config = _decoder_common(meta)
    _whole_head_rope(meta, config["head_dim"])
    _no_rope_scaling(meta)
    sliding = _window_pattern(meta, config["num_hidden_layers"], 2)
    return {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scale(config, 46),
        "attn_logit_softcapping": meta.float("attn_logit_softcapping", None),
        "final_logit_softcapping": meta.float("final_logit_softcapping", None),
        "sliding_window": meta.int("attention.sliding_window", 4096, maximum=MAX_POSITIONS),
        "layer_types": _layer_types(sliding),
        "attention_bias": False,
    }


def gemma3(meta: Metadata) -> dict[str, Any]:
    """Gemma 3 text: local layers (window, own RoPE base `rope.freq_base_swa`, default
    10000) and global ones (`rope.freq_base`, optionally linear RoPE scaling)."""
    config = _decoder_common(meta)
    _whole_head_rope(meta, config["head_dim"])
    layers = config["num_hidden_layers"]
    window = meta.int("attention.sliding_window", 0, minimum=0, maximum=MAX_POSITIONS)
    sliding = _window_pattern(meta, layers, 6) if window else [False] * layers
    local_theta = meta.float("rope.freq_base_swa", 10000.0)
    theta = config["rope_theta"]
    scaling_type = meta.raw("gemma3.rope.scaling.type")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling_type == "linear":
        full = {"rope_type": "linear", "rope_theta": theta, "factor": meta.float("rope.scaling.factor", 1.0)}
        config["rope_scaling"] = {"rope_type": "linear", "factor": full["factor"]}
    elif scaling_type not in (None, "none"):
        raise meta.refuse(f"uses RoPE scaling {str(scaling_type)[:40]!r}; qkv reads gemma3 files with linear scaling or none")
    if "rope_freqs.weight" in meta.tensor_names:
        raise meta.refuse("carries per-frequency RoPE factors (rope_freqs.weight), which qkv does not read from GGUF")
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **config,
        "rope_local_base_freq": local_theta,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scale(config, 62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta.float("final_logit_softcapping", None),
        "sliding_window": window or None,
        "layer_types": _layer_types(sliding),
        "attention_bias": False,
    }


# Tensors that hold settings rather than weights: Phi-3's LongRoPE factors, read into the config.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _rope_factors(meta: Metadata, name: str, count: int) -> list[float]:
    """One LongRoPE factor tensor (float32, one factor per rotated pair) as a list."""
    import numpy as np

    tensor = next(t for t in meta.reader.tensors if t.name == name)
    if tensor.tensor_type.name != "F32" or int(tensor.n_elements) != count:
        raise meta.refuse(f"has {name} of {int(tensor.n_elements)} {tensor.tensor_type.name} values, not {count} F32 ones")
    values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(values)) or not np.all(values > 0):
        raise meta.refuse(f"has {name} factors that are not positive finite numbers")
    return [float(v) for v in values]


def phi3(meta: Metadata) -> dict[str, Any]:
    """Phi-3 / Phi-3.5 / Phi-4-mini: partial rotary (`rope.dimension_count` < D), LongRoPE
    (the converter writes the long and short factors as tensors, no scaling type), and the
    sliding window the converter writes as 0 for 'none'."""
    config = _decoder_common(meta)
    if "rope_freqs.weight" in meta.tensor_names or meta.raw("phi3.rope.scaling.type") not in (None, "none"):
        raise meta.refuse("uses a RoPE scaling other than LongRoPE, which qkv does not read from GGUF")
    head_dim = config["head_dim"]
    rope_dim = meta.int("rope.dimension_count", head_dim, maximum=head_dim)
    if rope_dim % 2:
        raise meta.refuse(f"rotates an odd number of dimensions ({rope_dim})")
    window = meta.int("attention.sliding_window", 0, minimum=0, maximum=MAX_POSITIONS)
    original = meta.int("rope.scaling.original_context_length", config["max_position_embeddings"], maximum=MAX_POSITIONS)
    factor = rope_dim / head_dim
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if factor != 1.0:
        rope["partial_rotary_factor"] = factor
    present = [name for name in LONGROPE_TENSORS if name in meta.tensor_names]
    if present and len(present) != 2:
        raise meta.refuse(f"has {present[0]} without its pair; LongRoPE needs both the long and short factors")
    if present:
        rope = {"rope_type": "longrope", "rope_theta": config["rope_theta"], **({"partial_rotary_factor": factor} if factor != 1.0 else {}),
                "long_factor": _rope_factors(meta, LONGROPE_TENSORS[0], rope_dim // 2),
                "short_factor": _rope_factors(meta, LONGROPE_TENSORS[1], rope_dim // 2),
                "original_max_position_embeddings": original}
    config["rope_parameters"] = rope
    del config["head_dim"]  # Phi-3's config.json has none: D is C / H
    if config["hidden_size"] != head_dim * config["num_attention_heads"]:
        raise meta.refuse(f"has head size {head_dim}, not embedding_length / head_count as Phi-3 needs")
    return {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu", **config,
        "partial_rotary_factor": factor,
        "original_max_position_embeddings": original,
        "sliding_window": window or None,
    }


def olmo2(meta: Metadata) -> dict[str, Any]:
    """OLMo 2 (and OLMo 3, the same arch with sliding-window layers)."""
    config = _decoder_common(meta)
    _whole_head_rope(meta, config["head_dim"])
    if LLAMA3_ROPE_TENSOR in meta.tensor_names and meta.raw("llama.rope.scaling.type") in (None, "none"):
        config["rope_parameters"] = _llama3_rope(meta, config["head_dim"], config["rope_theta"])
    else:
        _no_rope_scaling(meta)
    window = meta.int("attention.sliding_window", 0, minimum=0, maximum=MAX_POSITIONS)
    common = {"hidden_act": "silu", **config, "attention_bias": False}
    if not window:
        del common["head_dim"]  # OLMo 2's config.json has none: D is C / H
        if config["hidden_size"] != config["head_dim"] * config["num_attention_heads"]:
            raise meta.refuse("has a head size other than embedding_length / head_count, which OLMo 2 cannot say")
        return {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", **common}
    sliding = _window_pattern(meta, config["num_hidden_layers"], 4)
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", **common,
            "sliding_window": window, "layer_types": _layer_types(sliding)}


# llama.cpp skips RoPE on every 4th SmolLM3 layer (n_no_rope_layer_step, not in the file).
SMOLLM3_NO_ROPE_INTERVAL = 4


def smollm3(meta: Metadata) -> dict[str, Any]:
    config = _decoder_common(meta)
    _whole_head_rope(meta, config["head_dim"])
    _implied_head_dim(config)
    _no_rope_scaling(meta)
    layers = config["num_hidden_layers"]
    return {
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_act": "silu", **config,
        "attention_bias": False, "mlp_bias": False,
        "no_rope_layer_interval": SMOLLM3_NO_ROPE_INTERVAL,
        "no_rope_layers": [int((i + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(layers)],
        "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
    }


def gpt2(meta: Metadata) -> dict[str, Any]:
    hidden = meta.int("embedding_length")
    heads = meta.layer_int("attention.head_count", maximum=hidden)
    if hidden % heads:
        raise meta.refuse(f"embedding_length {hidden} is not divisible by head_count {heads}")
    vocab = _vocab_size(meta)
    context = meta.int("context_length", maximum=MAX_POSITIONS)
    inner = meta.layer_int("feed_forward_length", 4 * hidden)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab, "n_positions": context, "n_embd": hidden, "n_head": heads,
        "n_layer": meta.int("block_count", maximum=MAX_LAYERS),
        "n_inner": None if inner == 4 * hidden else inner,
        "layer_norm_epsilon": meta.float("attention.layer_norm_epsilon", 1e-5),
        "activation_function": "gelu_new",
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        **_tokens(meta, vocab),
    }
