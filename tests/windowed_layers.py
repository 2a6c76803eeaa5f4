"""Local (sliding-window) attention layers for tests, until the model families build them.

`make_local(layer, window)` turns a GroupedQueryAttention layer into one whose queries see
only their last `window` keys, itself included: it gets the `window` attribute that the
trace, the key anatomy and the per-layer cache choice read, and applies the window mask
itself unless its cache already does (`windowed`), the contract a layer with a `window`
argument keeps. The parameters are the layer's own; only the class changes. Once
GroupedQueryAttention takes a `window` itself, setting the attribute is all it takes, and
the tests run the real layer.

Shape legend: B batch, T new tokens, S keys (cache included).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from qkv.attention import GroupedQueryAttention
from qkv.attention.caches.kv_cache import KVCache
from qkv.attention.caches.window_cache import sliding_window_mask


class LocalAttention(GroupedQueryAttention):
    window: int

    def forward(self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, **kwargs) -> Tensor:
        if cache is None:
            t = x.shape[1]
            local = sliding_window_mask(t, t, self.window, device=x.device)  # (T, T)
        elif not getattr(cache, "windowed", False):  # a full cache: slot s holds position s
            if positions is None:
                start = cache.length
                positions = torch.arange(start, start + x.shape[1], device=x.device)  # (T,)
            slots = torch.arange(cache.capacity, device=x.device)  # (S,)
            local = slots > positions[..., None] - self.window  # (T, S) or (B, T, S)
            if local.dim() == 3:
                local = local[:, None]  # (B, 1, T, S)
        else:  # the cache's own mask holds the window
            local = None
        if local is not None:
            mask = local if mask is None else mask & local
        return super().forward(x, mask=mask, positions=positions, cache=cache, **kwargs)


def make_local(layer: GroupedQueryAttention, window: int) -> GroupedQueryAttention:
    """The layer, local: by its own `window` where GroupedQueryAttention has one, else as a
    LocalAttention."""
    if "window" not in inspect.signature(GroupedQueryAttention.__init__).parameters:
        layer.__class__ = LocalAttention
    layer.window = window
    return layer
