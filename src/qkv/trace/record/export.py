"""A recorded layer as plain JSON values: what --json prints and the HTML page embeds.

Floats are rounded to float32's precision; a masked score (-inf) becomes null.

Shape legend: S keys, D head size.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from qkv.trace.record.recorder import LayerTrace


def plain(t: Tensor) -> Any:
    """Nested lists of floats with 7 significant digits; -inf/inf/nan -> None."""
    if t.dim() == 0:
        value = float(t)
        return None if not math.isfinite(value) else float(f"{value:.7g}")
    return [plain(row) for row in t.detach().float()]


def token_at(tokens: list[str] | None, position: int) -> str:
    if tokens is not None and 0 <= position < len(tokens):
        return tokens[position]
    return f"#{position + 1}"


def query_row(layer: LayerTrace, tokens: list[str] | None, head: int, query: int) -> dict[str, Any]:
    """Every step for one head and one query: the keys it compares with and what follows."""
    h, row = layer.head_slot(head), layer.query_slot(query)
    position = layer.cache_length + query  # absolute, from 0
    return {
        "layer": layer.index,
        "head": head,
        "kv_head": layer.kv_heads[h],
        "query": {"position": position + 1, "token": token_at(tokens, position)},
        "query_vector": plain(layer.q[0, h, row]),
        "query_unrotated": plain(layer.q_unrotated[0, h, row]) if layer.rope else None,
        "keys": plain(layer.keys[0, h]),
        # Before RoPE only the new tokens' keys exist (the cache keeps them rotated).
        "keys_unrotated": plain(layer.k_unrotated[0, h]) if layer.rope else None,
        "key_tokens": [token_at(tokens, s) for s in range(layer.num_keys)],
        "values": plain(layer.values[0, h]),
        "products": plain(layer.products[0, h, row]),
        "scores": plain(layer.scores[0, h, row]),
        "scaled_scores": plain(layer.scaled[0, h, row]),
        "visible": layer.mask[0, h, row].tolist(),
        "outside_window": layer.outside_window(query),  # hidden by a local layer's window
        "window": layer.window,
        "weights": plain(layer.weights[0, h, row]),
        "context": plain(layer.context[0, h, row]),
        "scale": layer.scale,
    }


def layer_summary(layer: LayerTrace) -> dict[str, Any]:
    return {
        "layer": layer.index,
        "module": layer.name or layer.kind,
        "kind": layer.kind,
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "heads": layer.heads,
        "queries": [q + 1 + layer.cache_length for q in layer.queries],
        "causal": layer.causal,
        "rope": layer.rope,
        "cache_length": layer.cache_length,
        "window": layer.window,  # keys a query of this local layer sees; None: a global layer
        "attention": "global" if layer.window is None else "local",
    }
