""""What the learned weights do" for every recorded layer, as the HTML page's data, so its
layer/head switch can show the numbers of the layer (and head) it is set to.

Per layer: the weight each head puts on the first token, the key/value groups and how alike
their heads attend, the key lengths by position; with RoPE, per recorded head, the score of
one rotated query/key pair by distance. Plain JSON values, unrounded: the
page rounds once, as it shows them.

Shape legend: S keys.
"""

from __future__ import annotations

from typing import Any

from qkv.trace.explain.analysis import analyse, rope_relative
from qkv.trace.record.recorder import LayerTrace, Trace


def _rope_view(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    if rope is None:
        return None
    return {"head": rope["head"], "query_position": rope["query_position"],
            "key_position": rope["key_position"],
            "largest_spread_at_equal_distance": rope["largest_spread_at_equal_distance"],
            "score_by_distance": [[d, s] for d, s in rope["score_by_distance"].items()]}


def layer_analysis(layer: LayerTrace, head: int, query: int) -> dict[str, Any]:
    """The page's analysis of one layer. `head` and `query` (from 0, among the new tokens) pick
    the RoPE pair when they were recorded (else the layer's first recorded head and query)."""
    head = head if head in layer.heads else layer.heads[0]
    query = query if query in layer.queries else layer.queries[-1]
    result = analyse(layer, head, query)
    rope_by_head = {}
    if layer.rope:
        for h in layer.heads:
            rope_by_head[str(h)] = _rope_view(rope_relative(layer, h, query, layer.cache_length))
    return {
        "sink_share": [[int(h), v] for h, v in result["sink_share"].items()],
        "sink_queries": result["sink_queries"],
        "kv_groups": [{"kv_head": g["kv_head"], "query_heads": g["query_heads"],
                       "within": g["within_group_similarity"],
                       "across": g["across_group_similarity"]} for g in result["kv_groups"]],
        "key_norms": result["key_norms"],
        "rope_by_head": rope_by_head,
    }


def trace_analyses(trace: Trace, head: int, query: int) -> list[dict[str, Any]]:
    """One analysis per recorded layer, in the trace's order."""
    return [layer_analysis(layer, head, query) for layer in trace.layers]
