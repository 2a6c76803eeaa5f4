"""How each attention module type computes its steps, re-done explicitly from its own parts.

An adapter takes one attention module, the arguments of one call to it (as a forward hook
sees them, after the call) and returns an `AttentionCall`: the layer input, the projection
matrices in the book's orientation (x @ W), the queries, keys and values of every head
before and after rotary position embedding, every key/value the call attended to (KV cache
included), the boolean mask and the scale. Nothing here is threaded through model code:
the adapters only read the module's parameters and the hook's arguments.

Shape legend: B batch, T new tokens, S key tokens (cache included), C input features,
H query heads, H_kv key/value heads, D head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.masks import causal_mask, combine_masks
from qkv.book import CausalAttention, MultiHeadAttention, SelfAttention_v1, SelfAttention_v2


@dataclass
class AttentionCall:
    """Every head of one call, as the explicit steps see it. O(T·C) memory, no (T, S) tensor
    except the boolean mask the module itself would build."""

    x: Tensor  # (B, T, C)
    W_query: Tensor  # (C, H*D), queries = x @ W_query + b_query
    W_key: Tensor  # (C, H_kv*D)
    W_value: Tensor  # (C, H_kv*D)
    b_query: Tensor | None
    b_key: Tensor | None
    b_value: Tensor | None
    q_unrotated: Tensor  # (B, H, T, D) after projection (and q-norm), before RoPE
    q: Tensor  # (B, H, T, D) what is compared with the keys
    k_unrotated: Tensor  # (B, H_kv, T, D) the new keys before RoPE
    k_new: Tensor  # (B, H_kv, T, D) the new keys as cached / compared
    keys: Tensor  # (B, H_kv, S, D) every key attended to, cache included
    values: Tensor  # (B, H_kv, S, D)
    mask: Tensor | None  # bool, broadcastable to (B, H, T, S), True = may attend
    scale: float
    causal: bool
    out_proj: nn.Module | None  # maps the concatenated heads (B, T, H*D) to the output
    cos: Tensor | None  # (T, D) rotations of the new tokens, when RoPE is used
    sin: Tensor | None
    unbatched: bool  # the module was called with (T, C) and answered (T, ...)
    softcap: float | None = None  # scaled scores become cap * tanh(scaled / cap) (Gemma 2)


def _linear_parts(layer: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """nn.Linear stores (out, in); the book writes x @ W with W of shape (in, out)."""
    bias = None if layer.bias is None else layer.bias.detach()
    weight = layer.dequantized() if hasattr(layer, "dequantized") else layer.weight  # int8/int4: what they stand for
    return weight.detach().T, bias


def projection_parts(module: GroupedQueryAttention) -> list[tuple[Tensor, Tensor | None]]:
    """(W, b) of the query, key and value projections as x @ W + b: from the three layers,
    or split from the fused one; a quantized layer shows the weights it stands for."""
    layers = module.projection_layers()
    if isinstance(layers, tuple):
        return [_linear_parts(layer) for layer in layers]
    weight = layers.dequantized() if hasattr(layers, "dequantized") else layers.weight
    weights = weight.detach().split(module.projection_sizes, dim=0)  # (H*D + 2*H_kv*D, C) -> three
    biases = (None,) * 3 if layers.bias is None else layers.bias.detach().split(module.projection_sizes)
    return [(w.T, b) for w, b in zip(weights, biases)]


def _heads(y: Tensor, num_heads: int) -> Tensor:
    b, t, _ = y.shape
    return y.view(b, t, num_heads, -1).transpose(1, 2)  # (B, H, T, D)


def _batched(x: Tensor) -> tuple[Tensor, bool]:
    return (x.unsqueeze(0), True) if x.dim() == 2 else (x, False)


def _cached(cache: object, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
    """After the call, the layer's KV cache (the `cache=` it was handed, if any) holds every
    key, the new ones last (the recorder checks that they equal the keys recomputed from the input)."""
    if cache is None:
        return k_new, v_new
    keys, values = cache.contents()  # (B, H_kv, S, D)
    return keys.detach().clone(), values.detach().clone()


def _single_head_call(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor,
                      bq: Tensor | None, bk: Tensor | None, bv: Tensor | None,
                      visible: Tensor | None, unbatched: bool) -> AttentionCall:
    def project(w: Tensor, b: Tensor | None) -> Tensor:
        y = x @ w if b is None else x @ w + b
        return y.unsqueeze(1)  # (B, 1, T, d_out): one head

    q, k, v = project(wq, bq), project(wk, bk), project(wv, bv)
    return AttentionCall(
        x=x, W_query=wq, W_key=wk, W_value=wv, b_query=bq, b_key=bk, b_value=bv,
        q_unrotated=q, q=q, k_unrotated=k, k_new=k, keys=k, values=v, mask=visible,
        scale=1.0 / math.sqrt(k.shape[-1]), causal=visible is not None, out_proj=None,
        cos=None, sin=None, unbatched=unbatched,
    )


def _self_attention_v1(module: SelfAttention_v1, args: tuple, kwargs: dict) -> AttentionCall:
    x, unbatched = _batched(args[0].detach())
    return _single_head_call(x, module.W_query.detach(), module.W_key.detach(),
                             module.W_value.detach(), None, None, None, None, unbatched)


def _self_attention_v2(module: SelfAttention_v2, args: tuple, kwargs: dict) -> AttentionCall:
    x, unbatched = _batched(args[0].detach())
    (wq, bq), (wk, bk), (wv, bv) = (_linear_parts(module.W_query), _linear_parts(module.W_key),
                                    _linear_parts(module.W_value))
    return _single_head_call(x, wq, wk, wv, bq, bk, bv, None, unbatched)


def _causal_attention(module: CausalAttention, args: tuple, kwargs: dict) -> AttentionCall:
    x = args[0].detach()
    t = x.shape[1]
    visible = ~module.mask.bool()[:t, :t]  # (T, T): the book stores 1 = hidden
    (wq, bq), (wk, bk), (wv, bv) = (_linear_parts(module.W_query), _linear_parts(module.W_key),
                                    _linear_parts(module.W_value))
    return _single_head_call(x, wq, wk, wv, bq, bk, bv, visible, False)


def _book_multi_head(module: MultiHeadAttention, args: tuple, kwargs: dict) -> AttentionCall:
    """The book's MultiHeadAttention: W_query, W_key, W_value, out_proj and its mask buffer."""
    x = args[0].detach()
    (wq, bq), (wk, bk), (wv, bv) = (_linear_parts(module.W_query), _linear_parts(module.W_key),
                                    _linear_parts(module.W_value))
    q = _heads(module.W_query(x), module.num_heads)  # (B, H, T, D)
    k = _heads(module.W_key(x), module.num_heads)
    v = _heads(module.W_value(x), module.num_heads)
    t = x.shape[1]
    visible = ~module.mask.bool()[:t, :t]  # (T, T): the book stores 1 = hidden
    return AttentionCall(
        x=x, W_query=wq, W_key=wk, W_value=wv, b_query=bq, b_key=bk, b_value=bv,
        q_unrotated=q, q=q, k_unrotated=k, k_new=k, keys=k, values=v,
        mask=visible, scale=1.0 / math.sqrt(q.shape[-1]), causal=True, out_proj=module.out_proj,
        cos=None, sin=None, unbatched=False,
    )


def _grouped_query(module: GroupedQueryAttention, args: tuple, kwargs: dict) -> AttentionCall:
    x = args[0].detach()
    cos, sin = kwargs.get("cos"), kwargs.get("sin")
    mask, is_causal = kwargs.get("mask"), kwargs.get("is_causal", True)
    (wq, bq), (wk, bk), (wv, bv) = projection_parts(module)
    b, t, _ = x.shape
    q, k, v_new = module.heads(x)  # (B, H, T, D), (B, H_kv, T, D) x 2: q/k-normed, not rotated
    rope = cos is not None and sin is not None
    q_rot = module.rotate(q, cos, sin) if rope else q  # (B, H, T, D)
    k_rot = module.rotate(k, cos, sin) if rope else k  # (B, H_kv, T, D)
    keys, values = _cached(kwargs.get("cache"), k_rot, v_new)
    s = keys.shape[2]
    full = combine_masks(mask, causal_mask(t, s, device=x.device) if is_causal else None)  # the window: _with_window
    return AttentionCall(
        x=x, W_query=wq, W_key=wk, W_value=wv, b_query=bq, b_key=bk, b_value=bv,
        q_unrotated=q, q=q_rot, k_unrotated=k, k_new=k_rot, keys=keys, values=values,
        mask=full, scale=module.score_scale, causal=bool(is_causal),
        out_proj=module.o_proj,
        cos=None if not rope else (cos[0] if cos.dim() == 3 else cos).detach(),
        sin=None if not rope else (sin[0] if sin.dim() == 3 else sin).detach(),
        unbatched=False, softcap=module.softcap,
    )


Adapter = Callable[[Any, tuple, dict], AttentionCall]

# Checked in order with isinstance: subclasses of these trace like their parents.
ADAPTERS: tuple[tuple[type[nn.Module], Adapter], ...] = (
    (SelfAttention_v1, _self_attention_v1),
    (SelfAttention_v2, _self_attention_v2),
    (CausalAttention, _causal_attention),
    (MultiHeadAttention, _book_multi_head),
    (GroupedQueryAttention, _grouped_query),
)


def adapter_for(module: nn.Module) -> Adapter | None:
    for kind, adapter in ADAPTERS:
        if isinstance(module, kind):
            return adapter
    return None


def dropout_p(module: nn.Module) -> float:
    """The dropout a call in training mode would apply to the weights."""
    drop = getattr(module, "dropout", 0.0)
    return float(drop.p) if isinstance(drop, nn.Dropout) else float(drop or 0.0)


def num_heads(module: nn.Module) -> tuple[int, int]:
    """(query heads, key/value heads) of a traceable module."""
    h = int(getattr(module, "num_heads", 1))
    return h, int(getattr(module, "num_kv_heads", h))


def supported_types() -> str:
    return ", ".join(kind.__name__ for kind, _ in ADAPTERS)


@torch.no_grad()
def explain_call(module: nn.Module, args: tuple, kwargs: dict) -> AttentionCall:
    adapter = adapter_for(module)
    if adapter is None:
        raise TypeError(f"{type(module).__name__} is not an attention module qkv can trace")
    return _with_window(module, adapter(module, args, kwargs))


def _with_window(module: nn.Module, call: AttentionCall) -> AttentionCall:
    """A local layer (its `window` attribute; None or absent: global) lets a query see only
    its last `window` keys: the call's mask says so too (AND-ing it again where the adapter
    already did changes nothing). The queries are the last T of the S keys."""
    window = getattr(module, "window", None)
    if window is None:
        return call
    from qkv.attention.caches.window_cache import sliding_window_mask

    t, s = call.q.shape[2], call.keys.shape[2]
    local = sliding_window_mask(t, s, window, device=call.q.device)  # (T, S)
    call.mask = local if call.mask is None else call.mask & local
    return call
