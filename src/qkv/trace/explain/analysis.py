"""What learned attention does, read off a recorded layer: numbers for the JSON and HTML.

- `sink_share`: per head, the mean weight the queries put on the first token (the
  "attention sink" trained decoders develop: a place to park weight that means nothing).
- `kv_groups`: which query heads share each key/value head (grouped-query attention), and
  how alike the attention patterns of the heads in a group are, against heads of other groups.
- `key_norms`: the length of each key, by position (sinks often have short or odd keys).
- `rope_relative`: with RoPE, rotate the same query and key vectors to other positions and
  show that their score depends only on the distance between the two positions.

All use batch item 0. Shape legend: h recorded heads, t recorded queries, S keys, D head size.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import torch
from torch import Tensor

from qkv.attention.rope import rotate_half
from qkv.trace.record.recorder import LayerTrace


# What kv_groups' similarities mean, in the words the terminal and the HTML page show.
ALIKE = ("alike: how similarly two heads spread their weights, 1 - the total variation distance "
         "between their weight rows, averaged over the queries (1: identical, 0: never the same "
         "keys). within: pairs of query heads that share the key/value head; across: pairs that "
         "do not (one number for the whole layer).")


def _absolute(layer: LayerTrace, query: int) -> int:
    return layer.cache_length + query


def _sink_rows(layer: LayerTrace) -> list[int]:
    """The recorded queries that can see more than key 0 (all, if none can)."""
    rows = [i for i, q in enumerate(layer.queries) if int(layer.mask[0, 0, i].sum()) > 1]
    return rows or list(range(len(layer.queries)))


def sink_share(layer: LayerTrace) -> dict[int, float]:
    """head -> mean weight on key 0, over the recorded queries that can see more than key 0."""
    weights = layer.weights[0][:, _sink_rows(layer), 0]  # (h, t')
    return {head: float(weights[i].mean()) for i, head in enumerate(layer.heads)}


def _similarity(a: Tensor, b: Tensor) -> float:
    """1 - total variation distance between two heads' weight rows, averaged over queries:
    1 when they attend identically, 0 when they never look at the same keys."""
    return float(1.0 - 0.5 * (a - b).abs().sum(-1).mean())


def kv_groups(layer: LayerTrace) -> list[dict[str, Any]]:
    """Per key/value head: the query heads that read it and how alike they attend."""
    groups = []
    weights = layer.weights[0].float()  # (h, t, S)
    for kv in range(layer.num_kv_heads):
        members = layer.query_heads_of(kv)
        recorded = [h for h in members if h in layer.heads]
        pairs = [(layer.head_slot(a), layer.head_slot(b)) for a, b in combinations(recorded, 2)]
        within = [_similarity(weights[a], weights[b]) for a, b in pairs]
        groups.append({
            "kv_head": kv,
            "query_heads": members,
            "within_group_similarity": sum(within) / len(within) if within else None,
        })
    across = [
        _similarity(weights[layer.head_slot(a)], weights[layer.head_slot(b)])
        for a, b in combinations(layer.heads, 2)
        if layer.kv_heads[layer.head_slot(a)] != layer.kv_heads[layer.head_slot(b)]
    ]
    mean_across = sum(across) / len(across) if across else None
    for group in groups:
        group["across_group_similarity"] = mean_across
    return groups


def key_norms(layer: LayerTrace) -> list[float]:
    """Mean length of the keys at each position, over the recorded key/value heads."""
    distinct = sorted(set(layer.kv_heads))
    slots = [layer.kv_heads.index(kv) for kv in distinct]
    return layer.keys[0, slots].norm(dim=-1).mean(0).tolist()  # (S,)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first cos.shape[-1] channels (all of them, or a partial rotary's share)."""
    r = cos.shape[-1]
    rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return rotated if r == x.shape[-1] else torch.cat((rotated, x[..., r:].expand(rotated.shape[:-1] + (-1,))), dim=-1)


def rope_relative(
    layer: LayerTrace, head: int, query: int, key: int, *, max_positions: int = 12
) -> dict[str, Any] | None:
    """The score of one (query, key) pair of vectors, rotated to every pair of positions the
    recorded rotation table covers. Same distance -> same score; other distance -> other score.

    `query` indexes the recorded queries' new tokens, `key` an absolute key position among
    the new tokens (both from 0); the positions it returns count from 1, as every position
    shown to a reader does. Returns None without RoPE.
    """
    if not layer.rope or layer.cos is None or layer.sin is None:
        return None
    slot, row = layer.head_slot(head), layer.query_slot(query)
    q = layer.q_unrotated[0, slot, row]  # (D,)
    k = layer.k_unrotated[0, slot, key - layer.cache_length]  # (D,)
    cos, sin = layer.cos.float(), layer.sin.float()  # (T, D) rows = new tokens
    t = min(cos.shape[0], max_positions)
    # Every position at once: the query rotated to each of t positions against the key rotated
    # to each, one (t, t) product (the page asks this for every layer and head).
    rotated_q = _rotate(q.float(), cos[:t], sin[:t])  # (t, D)
    rotated_k = _rotate(k.float(), cos[:t], sin[:t])  # (t, D)
    scores = (rotated_q @ rotated_k.T).tolist()  # (t, t): [m][n] = query at m, key at n
    pairs = []
    for m in range(t):
        for n in range(m + 1):
            score = scores[m][n]
            pairs.append({
                "query_position": layer.cache_length + m + 1,  # counted from 1, as shown
                "key_position": layer.cache_length + n + 1,
                "distance": m - n,
                "score": score,
            })
    by_distance: dict[int, list[float]] = {}
    for pair in pairs:
        by_distance.setdefault(pair["distance"], []).append(pair["score"])
    spread = max(max(v) - min(v) for v in by_distance.values())
    means = {d: sum(v) / len(v) for d, v in sorted(by_distance.items())}
    return {
        "head": head,
        "query_position": _absolute(layer, query) + 1,
        "key_position": key + 1,
        "pairs": pairs,
        "score_by_distance": means,
        "largest_spread_at_equal_distance": spread,
        "spread_across_distances": max(means.values()) - min(means.values()),
    }


def analyse(layer: LayerTrace, head: int, query: int) -> dict[str, Any]:
    """Every analysis that applies to the layer, for --json and the HTML page."""
    result: dict[str, Any] = {
        "sink_share": {str(h): v for h, v in sink_share(layer).items()},
        "sink_queries": len(_sink_rows(layer)),  # how many queries sink_share averages over
        "kv_groups": kv_groups(layer),
        "key_norms": key_norms(layer),
    }
    if layer.rope:
        first_key = layer.cache_length  # the first new token: its unrotated key was recorded
        result["rope"] = rope_relative(layer, head, query, first_key)
    return result
