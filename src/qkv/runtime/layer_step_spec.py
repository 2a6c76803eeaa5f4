"""A layer description (`qkv.models.configs.layer_spec.LayerSpec`) as qkv's native layer reads it.

`qkv::decoder_layer` (runtime/native/csrc/layer.cpp) runs whatever one `LayerSpec` describes within what
it implements: pre- and post-norms (RMS, Layer, Layer with bias, any weight offset folded
into the weight here), q/k RMS norms per head or over all heads (OLMo 2), RoPE on all or the first `rotary_dim`
channels of a head or none (NoPE), a score scale, a soft-cap, a sliding window, learned
attention sinks (one logit per head), and a gated (SwiGLU, GeGLU) or plain feed-forward with silu, tanh-GELU or erf-GELU. A description with a
part it does not implement is declined by `declined(spec)`, naming the part, and the layer
runs as modules: the decision reads the description, never a second list kept by hand.

    reason = declined(spec)            # None: the native layer runs it
    packed = pack(spec)                # (FIELDS,) float64, layer.cpp's `Field` order
    vectors = layer_vectors(spec, attn_norm=(w,), mlp_norm=(w,), q_norm=w, k_norm=w)

Shape legend: C hidden size, D head size, R rotary_dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.rope import Llama3RopeScaling, inverse_frequencies
from qkv.models.configs.layer_spec import LayerSpec, NormSpec, RopeSpec

LAYOUT = 3  # layer.cpp's LAYOUT: the version of FIELDS' order
FIELDS = ("version", "num_heads", "num_kv_heads", "head_dim",
          "attn_norm", "attn_norm_eps", "attn_post_norm", "attn_post_norm_eps",
          "mlp_norm", "mlp_norm_eps", "mlp_post_norm", "mlp_post_norm_eps",
          "qk_norm", "qk_norm_eps", "rotary_dim", "activation", "gated", "scale", "softcap", "window", "sinks",
          "qk_norm_over_all")
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # layer.cpp's ActivationKind
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _norm_code(norm: NormSpec | None) -> int:
    """layer.cpp's NormKind: 0 none, 1 RMS, 2 Layer, 3 Layer with bias."""
    if norm is None:
        return 0
    return 1 if norm.kind == "rms" else 3 if norm.bias else 2


def _llama3(rope: RopeSpec) -> Llama3RopeScaling | None:
    scaling = rope.scaling_dict or {}
    if _scaling_kind(rope) != "llama3":
        return None
    return Llama3RopeScaling(**{key: scaling[key] for key in LLAMA3_KEYS})  # type: ignore[arg-type]


def declined(spec: LayerSpec) -> str | None:
    """Why the native layer cannot run `spec` (the first part it lacks), or None."""
    att = spec.attention
    if att.qk_norm is not None and att.qk_norm.kind != "rms":
        return f"a {att.qk_norm.kind} q/k norm (the native layer has RMS q/k norms)"
    if spec.rope is not None and spec.rope.scaling:
        scaling = spec.rope.scaling_dict or {}
        kind = _scaling_kind(spec.rope)
        if not (kind == "default" or (kind == "llama3" and all(key in scaling for key in LLAMA3_KEYS))
                or (kind == "linear" and "factor" in scaling)):
            return f"RoPE scaling {kind!r} (the native layer has llama3's, linear, or none)"
    return None


def _scaling_kind(rope: RopeSpec) -> object:
    scaling = rope.scaling_dict or {}
    return scaling.get("rope_type", scaling.get("type"))


def pack(spec: LayerSpec) -> Tensor:
    """`spec` as layer.cpp's description: (FIELDS,) float64 in FIELDS' order. Raises
    ValueError naming the part when `declined(spec)` says the layer cannot run it."""
    reason = declined(spec)
    if reason is not None:
        raise ValueError(f"qkv's native layer cannot run {reason}")
    att, mlp, qk = spec.attention, spec.mlp, spec.attention.qk_norm
    values = {
        "version": LAYOUT, "num_heads": att.num_heads, "num_kv_heads": att.num_kv_heads, "head_dim": att.head_dim,
        "attn_norm": _norm_code(spec.attn_norm), "attn_norm_eps": spec.attn_norm.eps if spec.attn_norm else 0.0,
        "attn_post_norm": _norm_code(spec.attn_post_norm),
        "attn_post_norm_eps": spec.attn_post_norm.eps if spec.attn_post_norm else 0.0,
        "mlp_norm": _norm_code(spec.mlp_norm), "mlp_norm_eps": spec.mlp_norm.eps if spec.mlp_norm else 0.0,
        "mlp_post_norm": _norm_code(spec.mlp_post_norm),
        "mlp_post_norm_eps": spec.mlp_post_norm.eps if spec.mlp_post_norm else 0.0,
        "qk_norm": _norm_code(qk), "qk_norm_eps": qk.eps if qk else 0.0,
        "rotary_dim": spec.rope.rotary_dim if spec.rope else 0,
        "activation": ACTIVATIONS[mlp.activation], "gated": int(mlp.gated), "scale": att.score_scale,
        "softcap": att.softcap or 0.0, "window": att.window or 0, "sinks": int(att.sinks),
        "qk_norm_over_all": int(att.qk_norm_over == "all"),
    }
    return torch.tensor([float(values[name]) for name in FIELDS], dtype=torch.float64)


def rope_frequencies(rope: RopeSpec) -> Tensor:
    """(R/2,) float32 rotation speeds of the rotated channels: base ** (-2i / R), llama3-scaled
    or divided by a linear factor where the description says so (qkv.attention.rope and
    rope_scaling, what the modules compute)."""
    frequencies = inverse_frequencies(rope.rotary_dim, rope.base, _llama3(rope)).float()
    if _scaling_kind(rope) == "linear":
        frequencies = frequencies / float((rope.scaling_dict or {})["factor"])  # type: ignore[arg-type]
    return frequencies.contiguous()


def _norm_tensors(norm: NormSpec | None, tensors: tuple[Tensor, ...] | None, where: str) -> list[Tensor]:
    """A norm's [weight (+ offset), bias?] as float32 vectors, checked against its description."""
    if norm is None:
        if tensors:
            raise ValueError(f"the description has no {where}, but its weights were given")
        return []
    wanted = 2 if norm.bias else 1
    if tensors is None or len(tensors) != wanted:
        raise ValueError(f"the {where} takes {wanted} tensor(s) (weight{', bias' if norm.bias else ''})")
    weight = tensors[0].detach().float()
    weight = (weight + norm.weight_offset) if norm.weight_offset else weight  # Gemma's 1 + w, folded once
    return [weight.contiguous(), *(t.detach().float().contiguous() for t in tensors[1:])]


def packed_norm(norm: NormSpec, tensors: tuple[Tensor, ...]) -> tuple[int, list[Tensor]]:
    """One norm as the kernel reads it (the final norm, say): its NormKind code and its
    [weight (+ offset), bias?] float32 vectors."""
    return _norm_code(norm), _norm_tensors(norm, tensors, "final norm")


def layer_vectors(spec: LayerSpec, *, attn_norm: tuple[Tensor, ...] | None = None,
                  attn_post_norm: tuple[Tensor, ...] | None = None, mlp_norm: tuple[Tensor, ...] | None = None,
                  mlp_post_norm: tuple[Tensor, ...] | None = None, q_norm: Tensor | None = None,
                  k_norm: Tensor | None = None, inv_freq: Tensor | None = None,
                  sinks: Tensor | None = None) -> list[Tensor]:
    """The op's `vectors` in layer.cpp's order: each present norm's weight (and bias), the q and
    k norms' weights, RoPE's frequencies (`inv_freq`, else computed from the description), then
    the learned sinks (H,) where the description has them."""
    vectors = [*_norm_tensors(spec.attn_norm, attn_norm, "attention norm"),
               *_norm_tensors(spec.attn_post_norm, attn_post_norm, "attention post-norm"),
               *_norm_tensors(spec.mlp_norm, mlp_norm, "feed-forward norm"),
               *_norm_tensors(spec.mlp_post_norm, mlp_post_norm, "feed-forward post-norm")]
    qk = spec.attention.qk_norm
    if qk is not None:
        if q_norm is None or k_norm is None:
            raise ValueError("the description has q/k norms: give q_norm and k_norm")
        vectors += _norm_tensors(qk, (q_norm,), "q norm") + _norm_tensors(qk, (k_norm,), "k norm")
    if spec.rope is not None:
        frequencies = rope_frequencies(spec.rope) if inv_freq is None else inv_freq.float().contiguous()
        if frequencies.shape != (spec.rope.rotary_dim // 2,):
            raise ValueError(f"RoPE's frequencies must be ({spec.rope.rotary_dim // 2},), got {tuple(frequencies.shape)}")
        vectors.append(frequencies)
    if spec.attention.sinks:
        if sinks is None or sinks.shape != (spec.attention.num_heads,):
            raise ValueError(f"the description has learned sinks: give sinks ({spec.attention.num_heads},)")
        vectors.append(sinks.detach().float().contiguous())
    elif sinks is not None:
        raise ValueError("the description has no sinks, but sinks were given")
    return vectors
