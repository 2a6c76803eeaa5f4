"""One decoder layer described once, in family-neutral terms, read from a checkpoint's config.

Every decoder family qkv runs is the same skeleton with different parts:

    x = x + post_norm_a(attention(norm_a(x)))      # either norm may be absent
    x = x + post_norm_m(mlp(norm_m(x)))

A family's config reader fills in one `LayerSpec` per layer (layers of one model may differ:
Gemma's sliding-window and global layers, SmolLM3's layers without RoPE), and every backend
executes that description: the PyTorch modules built from it, and qkv's native decode kernels
(`qkv.runtime`), which read the same fields instead of a second, hand-kept copy of the layer.
A part a backend cannot run makes that backend decline the layer; it never guesses.

Shape legend: C hidden size, F feed-forward size, H query heads, H_kv key/value heads,
D head size, W window (keys a local layer's query sees).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

NormKind = Literal["rms", "layer"]
Activation = Literal["silu", "gelu_tanh", "gelu"]


@dataclass(frozen=True)
class NormSpec:
    """RMSNorm or LayerNorm over the last dimension. `weight_offset` is added to the stored
    weight before scaling (Gemma stores w and scales by 1 + w)."""

    kind: NormKind = "rms"
    eps: float = 1e-6
    weight_offset: float = 0.0
    bias: bool = False  # LayerNorm's shift (GPT-2); RMSNorm has none

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer"):
            raise ValueError(f"norm kind must be 'rms' or 'layer', got {self.kind!r}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"norm eps must be a positive number, got {self.eps}")
        if self.bias and self.kind != "layer":
            raise ValueError("only a LayerNorm has a bias")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding of one layer, rotate-half layout.

    rotary_dim: channels of each head that are rotated (the first ones; partial rotary, as
    Phi-4-mini's 0.75, leaves the rest unrotated). scaling: the config's `rope_scaling` as
    sorted (key, value) pairs (hashable), or () for none."""

    base: float
    rotary_dim: int
    scaling: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if not (self.base > 0 and math.isfinite(self.base)):
            raise ValueError(f"RoPE base must be a positive number, got {self.base}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"RoPE rotates channel pairs: rotary_dim must be even and >= 2, got {self.rotary_dim}")

    @property
    def scaling_dict(self) -> dict[str, object] | None:
        return dict(self.scaling) if self.scaling else None


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention of one layer.

    scale multiplies q.k (1/sqrt(D) unless the family says otherwise: Gemma's
    query_pre_attn_scalar). window: a query sees only the last `window` keys, itself included
    (None: every earlier key). softcap: scores become cap * tanh(scores / cap) (Gemma 2).
    sinks: a learned logit per head joins the softmax and takes weight but gives no value
    (gpt-oss). qk_norm normalises each head's query and key (`qk_norm_over="head"`, Qwen3,
    Gemma 3) or all heads' at once (`"all"`, OLMo 2)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: NormSpec | None = None
    qk_norm_over: Literal["head", "all"] = "head"

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window holds at least one key, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive, got {self.softcap}")
        if self.qk_norm_over not in ("head", "all"):
            raise ValueError(f"qk_norm_over must be 'head' or 'all', got {self.qk_norm_over!r}")

    @property
    def score_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale


@dataclass(frozen=True)
class MlpSpec:
    """The feed-forward block: gated (down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU
    with gelu_tanh) or plain (down(act(up(x))): GPT-2)."""

    intermediate_size: int
    activation: Activation = "silu"
    gated: bool = True
    bias: bool = False

    def __post_init__(self) -> None:
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be positive, got {self.intermediate_size}")
        if self.activation not in ("silu", "gelu_tanh", "gelu"):
            raise ValueError(f"unknown activation {self.activation!r}; qkv runs silu, gelu_tanh, gelu")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer (module docstring). rope None: a layer without positions (NoPE)."""

    attention: AttentionSpec
    mlp: MlpSpec
    rope: RopeSpec | None = None
    attn_norm: NormSpec | None = field(default_factory=NormSpec)
    attn_post_norm: NormSpec | None = None
    mlp_norm: NormSpec | None = field(default_factory=NormSpec)
    mlp_post_norm: NormSpec | None = None

    def __post_init__(self) -> None:
        if self.rope is not None and self.rope.rotary_dim > self.attention.head_dim:
            raise ValueError(f"RoPE rotates {self.rope.rotary_dim} channels of a head of "
                             f"{self.attention.head_dim}")

    @property
    def is_local(self) -> bool:
        """Whether the layer's queries see a sliding window rather than every earlier key."""
        return self.attention.window is not None
