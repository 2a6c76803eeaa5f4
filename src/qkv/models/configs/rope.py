"""A layer's RoPE read from config.json, in either spelling transformers writes.

transformers 4.x: `rope_theta` + `rope_scaling` ({"rope_type" or "type": ..., factors}), and
Gemma 3's `rope_local_base_freq` for its sliding-window layers. transformers 5: one
`rope_parameters` dict, or one per layer type ({"full_attention": {...},
"sliding_attention": {...}}: Gemma 3). `partial_rotary_factor` (Phi-4-mini) sits at the top
level or inside the parameters. The result is a `RopeSpec` whose `scaling` holds exactly what
`qkv.attention.rope_scaling` needs (LongRoPE's attention factor already worked out).
"""

from __future__ import annotations

import math
from typing import Any

from qkv.models.configs.fields import MAX_POSITIONS, check_float, check_int, get_dict, get_float
from qkv.models.configs.layer_spec import RopeSpec

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of one layer type as one flat dict (rope_type, rope_theta, ...)."""
    params = get_dict(config, "rope_parameters")
    if params and all(isinstance(v, dict) for v in params.values()):  # one dict per layer type
        chosen = params.get(layer_type or "full_attention")
        if not isinstance(chosen, dict):
            raise ValueError(f"rope_parameters has no entry for {layer_type or 'full_attention'!r} layers")
        return dict(chosen)
    if params:
        return dict(params)
    out = dict(get_dict(config, "rope_scaling"))
    if "rope_theta" in config:
        out.setdefault("rope_theta", config["rope_theta"])
    return out


def read_rope(
    config: dict[str, Any], head_dim: int, *, layer_type: str | None = None, default_theta: float = 10000.0,
) -> RopeSpec:
    """One layer's RopeSpec (module docstring). Unsupported scaling types raise ValueError."""
    params = rope_parameters(config, layer_type)
    theta = get_float(params, "rope_theta", default_theta, positive=True)
    kind = params.get("rope_type", params.get("type", "default"))
    kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's first name for LongRoPE
    if kind not in ROPE_TYPES:
        raise ValueError(f"RoPE scaling type {str(kind)[:40]!r} is not supported (qkv knows {', '.join(ROPE_TYPES)})")
    fraction = get_float(params, "partial_rotary_factor", config.get("partial_rotary_factor", 1.0),
                         positive=True, maximum=1.0)
    rotary_dim = int(head_dim * fraction)
    rotary_dim -= rotary_dim % 2
    scaling: dict[str, Any] = {}
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": get_float(params, "factor", positive=True)}
    elif kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        scaling = {"rope_type": "llama3", **{k: get_float(params, k, positive=True) for k in keys}}
        scaling["original_max_position_embeddings"] = check_int(
            "original_max_position_embeddings", params.get("original_max_position_embeddings"), maximum=MAX_POSITIONS)
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError(f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                             f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")
    elif kind == "longrope":
        scaling = _longrope(config, params, rotary_dim)
    return RopeSpec(base=theta, rotary_dim=rotary_dim, scaling=tuple(sorted(scaling.items())))


def _longrope(config: dict[str, Any], params: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    original = check_int("original_max_position_embeddings", original, minimum=2, maximum=MAX_POSITIONS)
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ValueError(f"LongRoPE's {name} must list {rotary_dim // 2} numbers, got "
                             f"{len(values) if isinstance(values, list) else type(values).__name__}")
        factors[name] = tuple(check_float(name, v, positive=True) for v in values)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        factor = params.get("factor")
        if factor is None:
            factor = get_float(config, "max_position_embeddings", 2048, positive=True) / original
        factor = check_float("factor", factor, positive=True)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "original_max_position_embeddings": original,
            "attention_factor": check_float("attention_factor", attention_factor, positive=True), **factors}
