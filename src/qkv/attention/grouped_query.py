"""A general attention layer: multi-head, grouped-query or multi-query, as decoders use it.

Options are constructor arguments, not branches threaded through callers: the number of
key/value heads (1 = multi-query, = num_heads = multi-head, in between = grouped-query),
a head size independent of the embedding size, q/k/v bias (Qwen2), per-head RMSNorm of
queries and keys (Qwen3), and the kernel backend. RoPE cos/sin arrive from the model; the
KV cache is handed to each call by the caller's decode session (any `KVCache` kind: the
layer only calls `update` and uses the mask the cache derives from the positions).
Likewise `ring`: a `qkv.attention.ring.Ring` attached by `qkv.models.context_parallel`
while a model runs context-parallel makes the layer attend its shard of the sequence
through ring attention.

Modules are named like the Hugging Face checkpoints they load (q_proj, k_proj, v_proj,
o_proj, q_norm, k_norm), so loading is a near-identity key map. For decoding,
`fuse_projections()` stacks q_proj, k_proj and v_proj into one `qkv_proj` (one matrix
product reads the three weights: at batch 1 each product is a pass over its weight, and
fewer, larger passes are faster); `project(x)` gives the three projections either way.

Shape legend: B batch, T new tokens, S key tokens (cache included), C embedding,
H query heads, H_kv key/value heads, D head size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.attention.kernels import BACKENDS, Backend, attention
from qkv.attention.kv_cache import CacheSpec, KVCache
from qkv.attention.ring import Ring
from qkv.attention.rmsnorm import RMSNorm
from qkv.attention.rope import RotaryEmbedding, apply_rope
from qkv.attention.stacking import stack_linears


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
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
        backend: Backend = "fused",
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
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.emb_dim = emb_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.backend: Backend = backend
        self.q_proj = nn.Linear(emb_dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(emb_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(emb_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, emb_dim, bias=out_bias)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections(), replacing the three
        self.q_norm: nn.Module = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.ring: Ring | None = None  # set only while the model runs context-parallel

    @property
    def projection_sizes(self) -> tuple[int, int, int]:
        """Output features of the query, key and value projections: H*D, H_kv*D, H_kv*D."""
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one `qkv_proj` holding their rows (same
        numbers, one matrix product). For inference: done by qkv.perf.prepare_for_decoding."""
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
        """What a KV cache for this layer holds (any kind is built from it: qkv.attention.kv_cache);
        `rotary` is the model's RoPE, for kinds that rotate keys as they read them."""
        return CacheSpec(batch_size, self.num_kv_heads, capacity, self.head_dim, self.head_dim,
                         dtype, torch.device(device), layer_index, rotary)

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
        q, k, v = self.project(x)
        q = q.view(b, t, self.num_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, D)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, H_kv, D)
        q = self.q_norm(q).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(k).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.transpose(1, 2)  # (B, H_kv, T, D)
        if cos is not None and sin is not None:
            q = apply_rope(q, cos, sin)
            if cache is None or not cache.rotates_keys:  # else the cache rotates them
                k = apply_rope(k, cos, sin)
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
            mask = visible if mask is None else mask & visible
            is_causal = False
        kernel = attention if self.ring is None else self.ring.attend  # the ring: every rank's keys
        context = kernel(
            q,
            k,
            v,
            mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )  # (B, H, T, D)
        context = context.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, H*D)
        return self.o_proj(context)
