"""Scaled dot-product attention: one signature, interchangeable backends (qkv.attention.registry).

- `explicit_attention` materialises every step of the book's data flow (scores = Q Kᵀ,
  scaled by 1/sqrt(d_k), masked with -inf, softmax over keys, dropout, weights @ V) and
  returns the weights too, because tracing and teaching need them.
- `fused_attention` calls `torch.nn.functional.scaled_dot_product_attention`, which never
  materialises the (T, S) matrix when it can avoid it and is much faster on long inputs.

Both accept (T, D), (B, T, D) or (B, H, T, D) queries, keys and values with any leading
batch dimensions, grouped-query keys/values (for 4-D and larger inputs: fewer heads on
dim -3 than the queries, dividing them evenly) and a boolean mask broadcastable to (..., T, S) where True means
"may attend". A query row whose keys are all masked gives zeros, never NaN.

Shape legend: B batch, H query heads, H_kv key/value heads, T query tokens, S key
tokens, D head size (queries/keys), D_v head size of values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.masks import causal_mask
from qkv.attention.registry import attention_function, register_attention
from qkv.names import ATTENTION_KERNELS, AttentionKernel  # noqa: F401  (re-exported: the names configs check)


_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            "queries, keys and values must have the same number of dimensions (at least 2: "
            f"tokens, features); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"queries and keys must have the same size per head to be compared by dot "
            f"products; got q[..., {q.shape[-1]}] and k[..., {k.shape[-1]}]"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"there must be one value per key; got {k.shape[-2]} keys and {v.shape[-2]} values"
        )
    if q.dim() >= 4 and k.shape[-3] != q.shape[-3]:
        if k.shape[-3] != v.shape[-3] or q.shape[-3] % k.shape[-3] != 0:
            raise ValueError(
                f"grouped-query attention needs the query heads ({q.shape[-3]}) to be a "
                f"multiple of the key/value heads (k: {k.shape[-3]}, v: {v.shape[-3]})"
            )
    # Every other leading (batch) dimension must match or broadcast; only heads group.
    head_dim = -3 if q.dim() >= 4 else None
    for dim in range(-q.dim(), -2):
        if dim == head_dim:
            continue
        sizes = {q.shape[dim], k.shape[dim], v.shape[dim]} - {1}
        if len(sizes) > 1:
            raise ValueError(
                f"queries, keys and values must agree on batch dimension {q.dim() + dim} (or be 1 "
                f"there); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )


def _full_mask(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor | None:
    """The boolean mask to apply: the given one, AND'ed with a causal one if asked.

    The causal mask aligns the queries with the *last* T keys (the KV-cache convention:
    query i sits at absolute position S - T + i), unlike SDPA's own `is_causal`, which
    aligns them with the first keys.
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    if not is_causal or q.shape[-2] == 1:
        # One query aligned with the last key sees every key: causality hides nothing.
        return mask
    offset = _causal_offset(q.shape[-2], k.shape[-2])
    causal = causal_mask(q.shape[-2], k.shape[-2], offset=offset, device=q.device)  # (T, S)
    return causal if mask is None else mask & causal


def repeat_kv(x: Tensor, num_query_heads: int) -> Tensor:
    """Expand (..., H_kv, S, D) keys or values to (..., H, S, D) for grouped-query attention.

    Query head h uses key/value head h // (H / H_kv): consecutive query heads form a group.
    """
    num_kv_heads = x.shape[-3]
    if num_kv_heads == num_query_heads:
        return x
    group = num_query_heads // num_kv_heads
    expanded = x.unsqueeze(-3).expand(*x.shape[:-2], group, *x.shape[-2:])  # (..., H_kv, G, S, D)
    return expanded.reshape(*x.shape[:-3], num_query_heads, *x.shape[-2:])  # (..., H, S, D)


def _fits_into(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to `target` without growing it. Plain Python on purpose:
    torch.broadcast_shapes imports torch's symbolic-shape machinery (about a second) on
    first use, which the book's six-token walkthrough would otherwise wait for."""
    return len(shape) <= len(target) and all(
        size in (1, full) for size, full in zip(reversed(shape), reversed(target)))


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Every step of attention, in the book's order. Returns (context, weights).

    context: (..., T, D_v); weights: (..., T, S), each row non-negative and summing to 1
    (or all zeros where every key is masked).
    """
    _check_shapes(q, k, v)
    if q.dim() >= 4:  # dim -3 is heads only from (B, H, T, D) on; in (B, T, D) it is the batch
        k = repeat_kv(k, q.shape[-3])
        v = repeat_kv(v, q.shape[-3])
    # scores is a fresh (..., T, S) tensor that autograd does not need back (the matmul
    # keeps q and k), so scaling and masking work on it in place: no extra T x S copies.
    scores = q @ k.transpose(-2, -1)  # (..., T, S)
    if scale is None:
        scores.div_(math.sqrt(k.shape[-1]))  # the book's 1/sqrt(d_k)
    else:
        scores.mul_(scale)
    full_mask = _full_mask(q, k, mask, is_causal)
    if full_mask is not None:
        hidden = ~full_mask
        if _fits_into(hidden.shape, scores.shape):
            scores.masked_fill_(hidden, -torch.inf)
        else:  # the mask adds batch dimensions: the result grows to its shape
            scores = scores.masked_fill(hidden, -torch.inf)
    # Softmax in float32 at least: half-precision exponentials lose the small weights.
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (..., T, S)
    if full_mask is not None:
        # A row with no visible key is all -inf, whose softmax is NaN: it attends to nothing.
        empty = ~full_mask.any(dim=-1, keepdim=True)  # (..., T, 1)
        if bool(empty.any()):
            weights = weights.masked_fill(empty, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weights @ v, weights


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """The same result through PyTorch's fused kernel. Returns the context only."""
    _check_shapes(q, k, v)
    grouped = q.dim() >= 4 and k.shape[-3] != q.shape[-3]
    if grouped and not (_SDPA_HAS_GQA and q.dim() == 4):
        k = repeat_kv(k, q.shape[-3])
        v = repeat_kv(v, q.shape[-3])
        grouped = False
    extra = {"enable_gqa": True} if grouped else {}
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    causal = is_causal and num_queries > 1  # one query aligned with the last key sees them all
    if mask is None:
        if not causal or num_queries == num_keys:
            # No mask, or square causal attention: the kernel skips the hidden blocks itself.
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p, **extra
            )
        # Queries after cached keys: query p sees keys 0..p, so no row is ever empty.
        offset = _causal_offset(num_queries, num_keys)
        sees_past = causal_mask(num_queries, num_keys, offset=offset, device=q.device)  # (T, S)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=sees_past, scale=scale, dropout_p=dropout_p, **extra
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    if not causal:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, **extra
        )
        return _zero_empty_rows(out, lambda: mask.any(dim=-1, keepdim=True))  # (..., T or 1, 1)
    offset = _causal_offset(num_queries, num_keys)  # query i sits at absolute position offset + i
    # SDPA takes one mask. Build it additive, in one pass over (..., T, S) from the two small
    # ones: a boolean AND would cost that pass too, then SDPA's own conversion to floats.
    hidden_future = torch.full(
        (num_queries, num_keys), -torch.inf, dtype=q.dtype, device=q.device
    ).triu_(offset + 1)  # (T, S): -inf where key j > offset + i, else 0
    key_bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, -torch.inf)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=hidden_future + key_bias, scale=scale, dropout_p=dropout_p, **extra
    )
    if mask.dim() >= 2 and mask.shape[-2] == 1 and mask.shape[-1] == num_keys:
        # A key-only mask (padding): causal row i sees keys 0..offset + i, so it keeps a key
        # iff that prefix of the key mask does. Row 0's prefix is the shortest: if every
        # row 0 keeps a key, no row is empty, found with one tiny reduction.
        if bool(mask[..., : offset + 1].any(dim=-1).all()):
            return out
        has_key_so_far = mask.cumsum(dim=-1) > 0  # (..., 1, S)
        return out.masked_fill(~has_key_so_far[..., offset:].transpose(-2, -1), 0.0)  # (..., T, 1)
    allowed = causal_mask(num_queries, num_keys, offset=offset, device=q.device)  # (T, S)
    return _zero_empty_rows(out, lambda: (mask & allowed).any(dim=-1, keepdim=True))


def _causal_offset(num_queries: int, num_keys: int) -> int:
    """Where the first query sits when the T queries are the last of the S keys."""
    if num_queries > num_keys:
        raise ValueError(
            f"causal attention aligns the queries with the last keys, so it needs at least as "
            f"many keys as queries; got {num_queries} queries and {num_keys} keys"
        )
    return num_keys - num_queries


def _zero_empty_rows(out: Tensor, visible: Callable[[], Tensor]) -> Tensor:
    """Zero the context of queries with no visible key (some SDPA versions give NaN there)."""
    rows = visible()  # (..., T, 1)
    return out if bool(rows.all()) else out.masked_fill(~rows, 0.0)


def one_query_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """Attention of a single query (a decode step) through the registry's "one_query":
    (..., H, 1, D) queries, (..., H_kv, S, D) keys -> (..., H, 1, D_v)."""
    return attention_function("one_query")(q, k, v, mask=mask, scale=scale)


def reduction_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """Attention of a single query written as two reductions.

    Compiled, Inductor turns `sum(q * k)` and `sum(weights * v)` into loops fused with the
    softmax and the neighbouring layers (and with whatever computed k and v: a quantized
    cache's dequantization), where an external SDPA call costs more in overhead (about
    0.1 ms per layer on a 2-core CPU) than the work at decode sizes. Grouped-query heads are
    broadcast, never copied. Accumulates in float32. A query with no visible key gets zeros.
    (..., H, 1, D) queries, (..., H_kv, S, D) keys -> (..., H, 1, D_v) context;
    mask broadcastable to (..., H, 1, S).
    """
    _check_shapes(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    grouped = q.dim() >= 4 and k.shape[-3] != q.shape[-3]
    if grouped:
        h, h_kv = q.shape[-3], k.shape[-3]
        q = q.unflatten(-3, (h_kv, h // h_kv))  # (..., H_kv, G, 1, D)
        k, v = k.unsqueeze(-3), v.unsqueeze(-3)  # (..., H_kv, 1, S, D)
        if mask is not None and mask.dim() >= 3:
            mask = mask.unsqueeze(-3) if mask.shape[-3] == 1 else mask.unflatten(-3, (h_kv, h // h_kv))
    scores = (q.float() * k.float()).sum(dim=-1) * scale  # (..., S): one score per key
    if mask is not None:
        visible = mask.squeeze(-2) if mask.dim() >= 2 else mask  # (..., S)
        scores = scores.masked_fill(~visible, -torch.inf)
    weights = torch.softmax(scores, dim=-1)  # (..., S)
    if mask is not None:
        weights = weights.nan_to_num(0.0)  # all keys hidden: softmax of -inf is NaN; attend to none
    context = (weights.unsqueeze(-1) * v.float()).sum(dim=-2, keepdim=True)  # (..., 1, D_v)
    if grouped:
        context = context.flatten(-4, -3)  # (..., H, 1, D_v)
    return context.to(q.dtype)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "fused",
) -> Tensor:
    """Context vectors through the attention function registered as `backend`
    (qkv.attention.registry); every backend gives the same answer."""
    return attention_function(backend)(q, k, v, mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p)


def _explicit_context(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, is_causal: bool = False,
                      scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    return explicit_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p)[0]


def _fused_or_one_query(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, is_causal: bool = False,
                        scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    if q.shape[-2] == 1 and dropout_p == 0.0:
        # One query aligned with the last key: causality hides nothing but the mask. PyTorch's
        # fused kernel was measured slower at one query, even with many keys: SmolLM2 in
        # bfloat16 at 4096 cached positions took 202 ms a step eagerly through it against 133 ms
        # as reductions, and 142 ms against 58 ms compiled (2 cores, AVX2).
        return attention_function("one_query")(q, k, v, mask=mask, scale=scale)
    return fused_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p)


def _reductions(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, is_causal: bool = False,
                scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    if q.shape[-2] != 1 or dropout_p:
        raise ValueError("the reductions backend attends one query without dropout")
    return reduction_attention(q, k, v, mask=mask, scale=scale)


register_attention("explicit", _explicit_context)
register_attention("fused", _fused_or_one_query)
register_attention("one_query", _reductions)
register_attention("reductions", _reductions)
