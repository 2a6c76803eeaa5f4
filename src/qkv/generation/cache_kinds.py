"""Cache kinds by name, and perplexity read through a cache.

    kind = cache_kind("int4", residual=64)            # full | int4 | int2 | sink
    result = cached_perplexity(model, ids, kind, capacity=len(ids), chunk=32)

`cached_perplexity` feeds a text through a model's caches `chunk` tokens at a time, each
chunk attending over what the cache answers (dequantized keys for a quantized cache, sinks
plus a window for a sink cache) and scoring its own next tokens: what decoding with that
cache would predict. A chunk's own keys are in full precision; a quantized cache keeps its
newest `residual` tokens so anyway, so chunks shorter than the residual score as decode does.

Shape legend: N tokens of the text.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, StaticKVCache
from qkv.attention.caches.quantized_cache import QuantizedKVCache
from qkv.attention.caches.sink_cache import SinkKVCache
from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder
from qkv.runtime.prepare import DecodeSetup
from qkv.runtime.session import DecodeSession

KINDS = ("full", "int4", "int2", "sink")


def cache_kind(name: str, *, sinks: int = 4, window: int = 252, residual: int = 64,
               group_size: int = 64, key_axis: str = "channel", rope: str = "before") -> CacheKind:
    """The cache kind called `name`; bad options raise QkvError naming them."""
    if name == "full":
        return StaticKVCache
    if name in ("int4", "int2"):
        if residual < 0 or group_size < 1:
            raise QkvError(f"--residual must be >= 0 and the group size >= 1, got {residual}, {group_size}")
        return QuantizedKVCache.kind(bits=int(name[3:]), residual=residual, group_size=group_size,
                                     sinks=sinks, key_axis=key_axis, rope=rope)
    if name == "sink":
        if window < 1:
            raise QkvError(f"--window must be at least 1, got {window}")
        if sinks < 0 or sinks > window:
            raise QkvError(f"--sink-tokens must be between 0 and the window ({window}), got {sinks}")
        return SinkKVCache.kind(sinks=sinks, window=window)
    raise QkvError(f"--kv-cache must be one of {', '.join(KINDS)}, got {name!r}")


def check_kind(model: CausalDecoder, kind: CacheKind, *, chunk: int = 1) -> None:
    """Build one layer's cache of `kind` for `model` (its dtype, a small capacity), so that a
    kind the model cannot use (a head size the codes do not divide, a dtype) or a chunk a
    sink cache cannot rotate within the context fails now, as one QkvError line, before
    anything long runs."""
    layer = next(iter(model.attention_layers()))
    reference = next(model.parameters())
    spec = CacheSpec(1, layer.num_kv_heads, min(64, model.context_length), layer.head_dim, layer.head_dim,
                     reference.dtype, reference.device, 0, model.rotary_embedding())
    try:
        cache = kind(spec)
    except ValueError as error:
        raise QkvError(f"--kv-cache cannot serve this model: {error}") from None
    if cache.rotates_keys and isinstance(cache, SinkKVCache):
        reach = cache.sinks + cache.window + max(chunk, cache.prefill_chunk)
        if reach > model.context_length:
            raise QkvError(f"--sink-tokens + --window + the tokens fed per call ({reach}) exceed the model's "
                           f"context length ({model.context_length}); use a smaller --window")


@dataclass(frozen=True)
class CachedPerplexity:
    perplexity: float
    nll: float
    tokens: int
    cache_nbytes: int
    window_nll: list[float]  # mean NLL of each consecutive slice of `slice_tokens`


@torch.no_grad()
def cached_perplexity(model: CausalDecoder, ids: Tensor, kind: CacheKind, *, capacity: int,
                      chunk: int = 32, slice_tokens: int = 512,
                      progress: Callable[[int], object] | None = None,
                      setup: DecodeSetup | None = None) -> CachedPerplexity:
    """Score ids (N,) through caches of `kind` (see the module docstring); `setup`: how the
    model was prepared (qkv.runtime.prepare), so one-token chunks run its native layers."""
    if chunk < 1:
        raise QkvError(f"the chunk size must be at least 1, got {chunk}")
    nlls: list[Tensor] = []
    with DecodeSession(model, capacity=capacity, kind=kind, exact_capacity=True, setup=setup) as session:
        n = ids.numel()
        for start in range(0, n - 1, chunk):
            part = ids[start:min(start + chunk, n - 1)]  # (t,)
            targets = ids[start + 1:start + 1 + part.shape[0]]  # (t,)
            logits = session.prefill_scores(part)  # (t, V)
            nlls.append(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none"))
            if progress is not None:
                progress(part.shape[0])
        nbytes = session.cache_nbytes()
    every = torch.cat(nlls)  # (N - 1,)
    slices = [float(every[i:i + slice_tokens].mean()) for i in range(0, every.numel(), slice_tokens)]
    nll = float(every.mean())
    return CachedPerplexity(math.exp(nll), nll, every.numel(), nbytes, slices)
