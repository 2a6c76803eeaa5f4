"""A general attention layer: multi-head, grouped-query or multi-query, as decoders use it.

Options are constructor arguments, not branches threaded through callers: the number of
key/value heads (1 = multi-query, = num_heads = multi-head, in between = grouped-query),
a head size independent of the embedding size, q/k/v bias (Qwen2), RMSNorm of queries and
keys per head (Qwen3, Gemma 3 with its 1 + w weights) or over all heads at once (OLMo 2),
the score scale (Gemma's query_pre_attn_scalar), soft-capped scores (Gemma 2), a sliding
`window` (a query sees only the last `window` keys, itself included: Mistral, Gemma's local
layers), partial rotary (`rotary_dim` < D: only the first channels rotate, Phi-4-mini), and
the kernel backend. A layer without RoPE (SmolLM3's NoPE layers) is simply handed no cos/sin. RoPE cos/sin arrive from the model; the
KV cache is handed to each call by the caller's decode session (any `KVCache` kind: the
layer only calls `update` and uses the mask the cache derives from the positions).
Likewise `ring`: a `qkv.attention.ring.Ring` attached by `qkv.models.context_parallel`
while a model runs context-parallel makes the layer attend its shard of the sequence
through ring attention.

Modules are named like the Hugging Face checkpoints they load (q_proj, k_proj, v_proj,
o_proj, q_norm, k_norm), so loading is a near-identity key map. For decoding,
`stack_projections()` stacks q_proj, k_proj and v_proj into one `qkv_proj` (one matrix
product reads the three weights: at batch 1 each product is a pass over its weight, and
fewer, larger passes are faster); `project(x)` gives the three projections either way.

Shape legend: B batch, T new tokens, S key tokens (cache included), C embedding,
H query heads, H_kv key/value heads, D head size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.attention.kernels import ATTENTION_KERNELS, AttentionKernel, attention
from qkv.attention.caches.kv_cache import CacheSpec, KVCache, StaticKVCache
from qkv.attention.masks import window_mask
from qkv.attention.ring import Ring
from qkv.attention.rmsnorm import RMSNorm
from qkv.attention.rope import RotaryEmbedding, apply_rope
from qkv.attention.softcap import softcapped_attention
from qkv.attention.stacking import stack_linears
from qkv.errors import QkvError


class GroupedQueryAttention(nn.Module):
    def __init__(
        self,
        emb_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_over: str = "head",
        qk_norm_offset: float = 0.0,
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
        backend: AttentionKernel = "fused",
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if emb_dim % num_heads != 0:
                raise ValueError(
                    f"emb_dim ({emb_dim}) must be divisible by num_heads ({num_heads}) "
                    "unless head_dim is given"
                )
            head_dim = emb_dim // num_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
            )
        if backend not in ATTENTION_KERNELS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
        if rotary_dim is not None and not (2 <= rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even, at least 2 and at most head_dim ({head_dim}), got {rotary_dim}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim  # the whole head, when RoPE is used
        if window is not None and window < 1:
            raise ValueError(f"a sliding window holds at least one key, got window={window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap}")
        if scale is not None and not scale > 0:
            raise ValueError(f"the score scale must be positive, got {scale}")
        if qk_norm_over not in ("head", "all"):
            raise ValueError(f"qk_norm_over must be 'head' or 'all', got {qk_norm_over!r}")
        self.emb_dim = emb_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.backend: AttentionKernel = backend
        self.scale = scale  # None: 1/sqrt(D)
        self.window = window  # None: a global layer (explain reads it)
        self.softcap = softcap
        self.rotary_dim = rotary_dim
        self.qk_norm_over = qk_norm_over
        self.q_proj = nn.Linear(emb_dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(emb_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(emb_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, emb_dim, bias=out_bias)
        self.qkv_proj: nn.Linear | None = None  # set by stack_projections(), replacing the three
        q_width, k_width = (head_dim, head_dim) if qk_norm_over == "head" else (num_heads * head_dim, num_kv_heads * head_dim)
        self.q_norm: nn.Module = RMSNorm(q_width, norm_eps, weight_offset=qk_norm_offset) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(k_width, norm_eps, weight_offset=qk_norm_offset) if qk_norm else nn.Identity()
        self.ring: Ring | None = None  # set only while the model runs context-parallel

    @property
    def projection_sizes(self) -> tuple[int, int, int]:
        """Output features of the query, key and value projections: H*D, H_kv*D, H_kv*D."""
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv

    def stack_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one `qkv_proj` holding their rows (same
        numbers, one matrix product). For inference: done by qkv.runtime.prepare.prepare_for_decoding."""
        if self.qkv_proj is None:
            self.qkv_proj = stack_linears([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C) -> the query, key and value projections (B, T, H*D), (B, T, H_kv*D) x 2."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = self.qkv_proj(x).split(self.projection_sizes, dim=-1)  # (B, T, H*D + 2*H_kv*D) -> three
        return q, k, v

    def projection_layers(self) -> tuple[nn.Module, nn.Module, nn.Module] | nn.Module:
        """The three projection layers, or the fused one (rows: queries, keys, values)."""
        if self.qkv_proj is None:
            return self.q_proj, self.k_proj, self.v_proj
        return self.qkv_proj

    def query_heads_of(self, kv_head: int) -> list[int]:
        """The query heads that share key/value head `kv_head`."""
        group = self.num_heads // self.num_kv_heads
        return list(range(kv_head * group, (kv_head + 1) * group))

    def cache_spec(
        self,
        batch_size: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_index: int = 0,
        rotary: RotaryEmbedding | None = None,
    ) -> CacheSpec:
        """What a KV cache for this layer holds (any kind is built from it: qkv.attention.caches.kv_cache);
        `rotary` is the model's RoPE, for kinds that rotate keys as they read them."""
        return CacheSpec(batch_size, self.num_kv_heads, capacity, self.head_dim, self.head_dim,
                         dtype, torch.device(device), layer_index, rotary)

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C) -> queries (B, H, T, D), keys and values (B, H_kv, T, D), normalised
        (q/k norm) but not yet rotated."""
        b, t, _ = x.shape
        q, k, v = self.project(x)
        if self.qk_norm_over == "all":  # one norm over every head's channels (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.num_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, D)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, D)
        if self.qk_norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), (B, H_kv, T, D) x 2

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on (B, H, T, D) queries or keys: the first `rotary_dim` channels (all of them
        unless the layer rotates only part of each head); cos/sin are (T, R) or (B, T, R)."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        r = self.rotary_dim
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)  # (B, H, T, D)

    @property
    def score_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    def window_visible(self, positions: Tensor, key_positions: Tensor,
                       cache: KVCache | None = None) -> Tensor | None:
        """The window's part of the mask, (B or 1, 1, T, S), or None: a global layer, or a
        cache that keeps only the window and whose mask already applies it (`windowed`)."""
        if self.window is None or getattr(cache, "windowed", False):
            return None
        if cache is not None and not isinstance(cache, StaticKVCache):
            # the window is read off slot numbers, which only a full cache keeps as positions
            raise QkvError(f"this model's sliding-window layers (window {self.window}) run on the full KV cache "
                           f"or a window cache, not on a {type(cache).__name__}; choose the full cache")
        return window_mask(key_positions, positions, self.window)

    def forward(
        self,
        x: Tensor,
        *,
        cos: Tensor | None = None,
        sin: Tensor | None = None,
        mask: Tensor | None = None,
        is_causal: bool = True,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x: (B, T, C). mask: boolean, broadcastable to (B, H, T, S), True = may attend.

        cache: this layer's KV cache in the caller's session (None: attend over x alone).
        positions (T,) or (B, T): where the new tokens sit, used with a cache, whose own
        mask (derived from them) then replaces causality; by default they follow what the
        cache holds (a read of the cache's length: models pass them instead).
        """
        if x.dim() != 3 or x.shape[-1] != self.emb_dim:
            raise ValueError(
                f"attention input must be (batch, tokens, {self.emb_dim}), got {tuple(x.shape)}"
            )
        b, t, _ = x.shape
        q, k, v = self.heads(x)  # (B, H, T, D), (B, H_kv, T, D) x 2
        if cos is not None and sin is not None:
            q = self.rotate(q, cos, sin)
            if cache is None or not cache.rotates_keys:  # else the cache rotates them
                k = self.rotate(k, cos, sin)
        if cache is not None:
            if positions is None:  # a direct call: the tokens follow what the cache holds
                start = cache.length
                positions = torch.arange(start, start + t, device=x.device)  # (T,)
            if (t == 1 and mask is None and self.backend == "fused" and self.ring is None
                    and cache.attends_decode_step):
                # The cache writes the step and attends it from its own codes (quantized_cache).
                context = cache.decode_attention(q, k, v, positions)  # (B, H, 1, D)
                return self.o_proj(context.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
            k, v, visible = cache.update(k, v, positions)  # (B, H_kv, S, D), (B, 1, T, S)
            # A full cache holds position p at slot p: the window reads slot numbers.
            local = self.window_visible(positions, torch.arange(k.shape[2], device=x.device), cache)
            visible = visible if local is None else visible & local
            mask = visible if mask is None else mask & visible
            is_causal = False
        elif self.window is not None:
            if positions is None:
                positions = torch.arange(t, device=x.device)  # (T,)
            local = window_mask(positions, positions, self.window)  # (B or 1, 1, T, T)
            mask = local if mask is None else mask & local  # causality stays with is_causal
        if self.softcap is not None:
            if self.ring is not None:
                raise ValueError("ring attention does not soft-cap scores; run this model on one process")
            context, _ = softcapped_attention(q, k, v, softcap=self.softcap, scale=self.score_scale, mask=mask,
                                              is_causal=is_causal)  # (B, H, T, D)
        else:
            if self.ring is not None and self.window is not None:
                raise ValueError("ring attention does not slide a window; run this model on one process")
            kernel = attention if self.ring is None else self.ring.attend  # the ring: every rank's keys
            context = kernel(
                q,
                k,
                v,
                mask=mask,
                is_causal=is_causal,
                scale=self.scale,
                dropout_p=self.dropout if self.training else 0.0,
                backend=self.backend,
            )  # (B, H, T, D)
        context = context.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(context)
