"""Config readers: a Hugging Face config.json of each family -> its `DecoderSpec`.

One function per family, each reading only the fields that family's config class defines
(its transformers defaults where a field is absent) and saying, per layer, what
`qkv.models.configs.layer_spec` describes:

- Llama / SmolLM2, Qwen2, Qwen3 (`llama_decoder_spec`, from their LlamaConfig classes):
  pre-RMSNorm, SwiGLU, one RoPE; Qwen2 q/k/v biases, Qwen3 per-head q/k norm.
- Mistral: Llama's layer with a sliding window on every layer (`sliding_window`, or none).
- Phi-3 / Phi-4-mini: q/k/v and gate/up stored stacked, LongRoPE (`rope_scaling` type
  longrope or su), partial rotary (`partial_rotary_factor`), `sliding_window`.
- Gemma 2: (1 + w) RMSNorms before and after attention and MLP, GeGLU, embeddings scaled by
  sqrt(C), scores scaled by query_pre_attn_scalar^-1/2 and soft-capped, logits soft-capped,
  sliding and global layers alternating (`layer_types`).
- Gemma 3 (text): Gemma 2's layer with per-head (1 + w) q/k norms, five sliding layers per
  global one, the local layers' own RoPE base and the global layers' scaled RoPE.
- OLMo 2: no norm before attention or MLP, a norm after each, q/k norm over all heads.
- SmolLM3: Llama's layer, RoPE left out on the layers `no_rope_layers` marks 0 (NoPE).

Every value is checked (qkv.models.configs.fields); an impossible one raises ValueError naming it.
"""

from __future__ import annotations

from typing import Any

from qkv.models.configs.decoder_spec import DecoderSpec
from qkv.models.configs.fields import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, get_bool, get_float, get_int, get_str
from qkv.models.configs.layer_spec import AttentionSpec, LayerSpec, MlpSpec, NormSpec, RopeSpec
from qkv.models.configs.llama import LlamaConfig, require
from qkv.models.configs.rope import read_rope

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu"}


def _sizes(config: dict[str, Any]) -> dict[str, Any]:
    require(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hidden = get_int(config, "hidden_size")
    heads = get_int(config, "num_attention_heads", maximum=hidden)
    kv_heads = get_int(config, "num_key_value_heads", None, maximum=heads)
    head_dim = get_int(config, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}); give head_dim")
        head_dim = hidden // heads
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    return dict(
        vocab_size=get_int(config, "vocab_size", maximum=MAX_VOCAB), hidden=hidden, heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim,
        intermediate=get_int(config, "intermediate_size"),
        layers=get_int(config, "num_hidden_layers", maximum=MAX_LAYERS),
        eps=get_float(config, "rms_norm_eps", 1e-6, positive=True, maximum=1.0),
        context=get_int(config, "max_position_embeddings", 2048, maximum=MAX_POSITIONS),
    )


def _activation(config: dict[str, Any], key: str, default: str) -> str:
    name = get_str(config, key, default) if config.get(key) is not None else default
    if name not in ACTIVATIONS:
        raise ValueError(f"{key} {name[:40]!r} is not supported (qkv runs {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _layer_types(config: dict[str, Any], count: int, default: list[str]) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != count or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must list {count} entries, each {SLIDING!r} or {FULL!r}")
    return types


def _window(config: dict[str, Any]) -> int | None:
    return get_int(config, "sliding_window", None, maximum=MAX_POSITIONS)


def _llama_like(config: dict[str, Any], *, model_type: str, windows: list[int | None] | None = None,
                ropes: list[RopeSpec | None] | None = None, tie_default: bool = False,
                stacked: bool = False, out_bias: bool | None = None) -> DecoderSpec:
    """Llama's layer (pre-RMSNorm, SwiGLU) with per-layer windows and RoPE (None: NoPE)."""
    s = _sizes(config)
    act = _activation(config, "hidden_act", "silu")
    bias = get_bool(config, "attention_bias", False)
    norm = NormSpec(eps=s["eps"])
    rope = read_rope(config, s["head_dim"])
    layers = []
    for i in range(s["layers"]):
        attention = AttentionSpec(s["heads"], s["kv_heads"], s["head_dim"], qkv_bias=bias,
                                  out_bias=bias if out_bias is None else out_bias,
                                  window=None if windows is None else windows[i])
        mlp = MlpSpec(s["intermediate"], activation=act, bias=get_bool(config, "mlp_bias", False))  # type: ignore[arg-type]
        layers.append(LayerSpec(attention, mlp, rope=rope if ropes is None else ropes[i], attn_norm=norm, mlp_norm=norm))
    return DecoderSpec(model_type, s["vocab_size"], s["hidden"], tuple(layers), s["context"], final_norm=norm,
                       tie_word_embeddings=get_bool(config, "tie_word_embeddings", tie_default),
                       stacked_qkv=stacked, stacked_gate_up=stacked)


def mistral_spec(config: dict[str, Any]) -> DecoderSpec:
    """MistralForCausalLM: every layer slides `sliding_window` keys (none when null)."""
    window = _window(config)
    return _llama_like(config, model_type="mistral", windows=[window] * get_int(config, "num_hidden_layers", maximum=MAX_LAYERS))


def phi3_spec(config: dict[str, Any]) -> DecoderSpec:
    """Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4-mini): stacked qkv_proj and gate_up_proj."""
    window = _window(config)
    return _llama_like(config, model_type="phi3", windows=[window] * get_int(config, "num_hidden_layers", maximum=MAX_LAYERS),
                       stacked=True)


def smollm3_spec(config: dict[str, Any]) -> DecoderSpec:
    """SmolLM3ForCausalLM: no_rope_layers[i] = 0 leaves RoPE out of layer i."""
    count = get_int(config, "num_hidden_layers", maximum=MAX_LAYERS)
    interval = get_int(config, "no_rope_layer_interval", 4)
    uses_rope = config.get("no_rope_layers")
    if uses_rope is None:
        uses_rope = [int((i + 1) % interval != 0) for i in range(count)]
    if not isinstance(uses_rope, list) or len(uses_rope) != count or any(u not in (0, 1) for u in uses_rope):
        raise ValueError(f"no_rope_layers must list {count} entries of 0 (no RoPE) or 1")
    window = _window(config) if get_bool(config, "use_sliding_window", False) else None
    types = _layer_types(config, count, [FULL] * count)
    rope = read_rope(config, _sizes(config)["head_dim"], default_theta=2000000.0)
    return _llama_like(config, model_type="smollm3", tie_default=True,
                       windows=[window if t == SLIDING else None for t in types],
                       ropes=[rope if u else None for u in uses_rope])


def olmo2_spec(config: dict[str, Any]) -> DecoderSpec:
    """Olmo2ForCausalLM: norms after attention and MLP only; q/k norm over all heads."""
    s = _sizes(config)
    norm = NormSpec(eps=s["eps"])
    bias = get_bool(config, "attention_bias", False)
    rope = read_rope(config, s["head_dim"])
    attention = AttentionSpec(s["heads"], s["kv_heads"], s["head_dim"], qkv_bias=bias, out_bias=bias,
                              qk_norm=norm, qk_norm_over="all")
    mlp = MlpSpec(s["intermediate"], activation=_activation(config, "hidden_act", "silu"))  # type: ignore[arg-type]
    layer = LayerSpec(attention, mlp, rope=rope, attn_norm=None, attn_post_norm=norm, mlp_norm=None,
                      mlp_post_norm=norm)
    return DecoderSpec("olmo2", s["vocab_size"], s["hidden"], (layer,) * s["layers"], s["context"], final_norm=norm,
                       tie_word_embeddings=get_bool(config, "tie_word_embeddings", False))


def _gemma_spec(config: dict[str, Any], *, model_type: str, qk_norm: bool, default_pattern: int,
                ropes: dict[str, RopeSpec], softcap_defaults: tuple[float | None, float | None]) -> DecoderSpec:
    s = _sizes(config)
    norm = NormSpec(eps=s["eps"], weight_offset=1.0)
    bias = get_bool(config, "attention_bias", False)
    scalar = get_float(config, "query_pre_attn_scalar", 256, positive=True)
    attn_cap = config.get("attn_logit_softcapping", softcap_defaults[0])
    final_cap = config.get("final_logit_softcapping", softcap_defaults[1])
    attn_cap = None if attn_cap is None else get_float(config, "attn_logit_softcapping", positive=True)
    final_cap = None if final_cap is None else get_float(config, "final_logit_softcapping", positive=True)
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", default_pattern))
    pattern = get_int({"sliding_window_pattern": pattern}, "sliding_window_pattern", maximum=MAX_LAYERS)
    types = _layer_types(config, s["layers"], [SLIDING if (i + 1) % pattern else FULL for i in range(s["layers"])])
    window = _window(config)
    mlp = MlpSpec(s["intermediate"], activation=_activation(  # type: ignore[arg-type]
        config, "hidden_activation" if config.get("hidden_activation") is not None else "hidden_act", "gelu_pytorch_tanh"))
    layers = []
    for kind in types:
        attention = AttentionSpec(s["heads"], s["kv_heads"], s["head_dim"], scale=scalar ** -0.5,
                                  window=window if kind == SLIDING else None, softcap=attn_cap,
                                  qkv_bias=bias, out_bias=bias, qk_norm=norm if qk_norm else None)
        layers.append(LayerSpec(attention, mlp, rope=ropes[kind], attn_norm=norm, attn_post_norm=norm,
                                mlp_norm=norm, mlp_post_norm=norm))
    return DecoderSpec(model_type, s["vocab_size"], s["hidden"], tuple(layers), s["context"], final_norm=norm,
                       embedding_scale=s["hidden"] ** 0.5, final_softcap=final_cap,
                       tie_word_embeddings=get_bool(config, "tie_word_embeddings", True))


def gemma2_spec(config: dict[str, Any]) -> DecoderSpec:
    """Gemma2ForCausalLM: sliding and global layers alternate, starting with a sliding one."""
    rope = read_rope(config, _sizes(config)["head_dim"])
    return _gemma_spec(config, model_type="gemma2", qk_norm=False, default_pattern=2,
                       ropes={SLIDING: rope, FULL: rope}, softcap_defaults=(50.0, 30.0))


def gemma3_text_spec(config: dict[str, Any]) -> DecoderSpec:
    """Gemma3ForCausalLM (model_type gemma3_text), or the text half of a gemma3 config."""
    if config.get("model_type") == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("a gemma3 config.json must hold its text model's settings in text_config")
        # the whole model's head tying is the text model's (transformers ties the two)
        config = {**text, **({"tie_word_embeddings": config["tie_word_embeddings"]}
                             if config.get("tie_word_embeddings") is not None else {})}
    head_dim = _sizes(config)["head_dim"]
    ropes = {
        FULL: read_rope(config, head_dim, layer_type=FULL, default_theta=1_000_000.0),
        SLIDING: _gemma3_local_rope(config, head_dim),
    }
    return _gemma_spec(config, model_type="gemma3_text", qk_norm=True, default_pattern=6, ropes=ropes,
                       softcap_defaults=(None, None))


def _gemma3_local_rope(config: dict[str, Any], head_dim: int) -> RopeSpec:
    """The local layers' RoPE: their own base (rope_local_base_freq), never scaled."""
    if "rope_local_base_freq" in config or "rope_parameters" not in config:
        base = get_float(config, "rope_local_base_freq", 10000.0, positive=True)
        return RopeSpec(base=base, rotary_dim=head_dim)
    return read_rope(config, head_dim, layer_type=SLIDING, default_theta=10000.0)


def llama_decoder_spec(cfg: LlamaConfig) -> DecoderSpec:
    """A Llama, Qwen2 or Qwen3 config (qkv.models.configs.llama, qkv.models.configs.qwen) as a spec."""
    norm = NormSpec(eps=cfg.rms_norm_eps)
    scaling: tuple[tuple[str, object], ...] = ()
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling
        scaling = tuple(sorted({"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                                "high_freq_factor": r.high_freq_factor,
                                "original_max_position_embeddings": r.original_max_position_embeddings}.items()))
    head_dim = cfg.head_dim
    assert head_dim is not None and cfg.num_key_value_heads is not None  # set by LlamaConfig.__post_init__
    rope = RopeSpec(base=cfg.rope_theta, rotary_dim=head_dim, scaling=scaling)
    attention = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                              qkv_bias=cfg.attention_bias, out_bias=cfg.attention_out_bias,
                              qk_norm=norm if cfg.qk_norm else None)
    layer = LayerSpec(attention, MlpSpec(cfg.intermediate_size, bias=cfg.mlp_bias), rope=rope,
                      attn_norm=norm, mlp_norm=norm)
    model_type = {"Qwen2Config": "qwen2", "Qwen3Config": "qwen3"}.get(type(cfg).__name__, "llama")
    return DecoderSpec(model_type, cfg.vocab_size, cfg.hidden_size, (layer,) * cfg.num_hidden_layers,
                       cfg.max_position_embeddings, final_norm=norm, tie_word_embeddings=cfg.tie_word_embeddings)
