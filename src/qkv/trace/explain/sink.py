"""The sink explained: which sources make the first token's key attractive.

Trained decoders park attention on the first token (the "sink"; `qkv.trace.explain.keys` measures
its mass per head). For the heads with the most sink mass, this splits the first key's
score, averaged over the queries that can see more than it, into the exact (query source,
key source) terms of `qkv.trace.explain.attribution`: a mean of exact splits is an exact split of
the mean score, and each query's split is checked against the model's score.

    sinks = explain_sinks(model, input_ids, count=5)
    sinks[0].key_totals()        # which key-side sources carry the sink, per source

Shape legend: P queries averaged over, D head size, nq / nk query / key sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.trace.explain.attribution import (check_split, head_projections, side_shares, record_forward)
from qkv.trace.explain.keys import key_anatomy


@dataclass
class SinkAttribution:
    layer: int
    head: int
    kv_head: int
    sink_mass: float  # mean weight the queries put on the first token
    queries: int  # how many queries the split is averaged over
    query_sources: list[str]
    key_sources: list[str]
    pairs: Tensor  # (nq, nk) float64: the mean over queries of q_s · k_t against key 0
    score: float  # mean over those queries of the model's score against key 0
    scale: float

    def key_totals(self) -> list[tuple[str, float]]:
        """Key-side sources by their share of the mean score, largest first."""
        totals = self.pairs.sum(0)
        return sorted(zip(self.key_sources, totals.tolist()), key=lambda kv: -abs(kv[1]))

    def top_pairs(self, count: int = 3) -> list[tuple[str, str, float]]:
        flat = self.pairs.flatten()
        nk = self.pairs.shape[1]
        order = flat.abs().argsort(descending=True)[:count]
        return [(self.query_sources[int(i) // nk], self.key_sources[int(i) % nk], float(flat[i])) for i in order]

    def top_share(self, count: int = 3) -> float:
        """Sum of the `count` largest terms over the score (can pass 1 when others cancel)."""
        return sum(t for _, _, t in self.top_pairs(count)) / self.score if self.score else float("nan")

    def top_size_share(self, count: int = 3) -> float:
        """The `count` largest |terms| over the sum of all |terms|."""
        sizes = self.pairs.abs().flatten()
        return float(sizes.topk(min(count, sizes.numel())).values.sum() / sizes.sum().clamp_min(1e-300))

    def to_json(self) -> dict:
        return {"layer": self.layer, "head": self.head, "kv_head": self.kv_head, "sink_mass": self.sink_mass,
                "queries": self.queries, "score": self.score, "scaled": self.score * self.scale,
                "top_pairs": [{"query_source": q, "key_source": k, "term": t} for q, k, t in self.top_pairs(5)],
                "top3_share_of_score": self.top_share(3), "top3_share_of_term_sizes": self.top_size_share(3),
                "key_sources": [{"source": s, "term": t} for s, t in self.key_totals()[:10]]}


def sink_heads(model: nn.Module, input_ids: Tensor, count: int) -> list[tuple[int, int, float]]:
    """(layer, head, sink mass) of the `count` query heads with the most weight on token 0."""
    anatomy = key_anatomy(model, input_ids)
    cells = []
    for head in anatomy.heads:
        group = len(head.sink_mass)
        for g, mass in enumerate(head.sink_mass):
            cells.append((head.layer, head.kv_head * group + g, mass))
    return sorted(cells, key=lambda c: -c[2])[:count]


@torch.no_grad()
def explain_sinks(model: nn.Module, input_ids: Tensor, *, count: int = 5,
                  heads: list[tuple[int, int]] | None = None) -> list[SinkAttribution]:
    """Split the first key's mean score for the `count` heads with the most sink mass (or
    the given (layer, head) pairs). Needs at least 2 tokens."""
    t = int(input_ids.shape[1])
    if t < 2:
        raise QkvError("the sink needs at least 2 tokens: a query after the first")
    chosen = sink_heads(model, input_ids, count) if heads is None else [(l, h, float("nan")) for l, h in heads]
    record = record_forward(model, input_ids, layers=sorted({l for l, _, _ in chosen}))
    out = []
    for layer, head, mass in chosen:
        trace = record.traces[layer]
        attention = record.layout.blocks[layer].attention
        kv_head = head // (attention.num_heads // attention.num_kv_heads)
        (w_q, b_q), (w_k, b_k) = head_projections(attention, head, kv_head)
        queries = torch.arange(1, t)  # (P,) every query that sees more than the sink
        key = torch.tensor([0])
        src = record.sources
        q_norm = (attention.q_norm, src.q_norm_in[layer][queries, head]) if layer in src.q_norm_in else None
        k_norm = (attention.k_norm, src.k_norm_in[layer][key, kv_head]) if layer in src.k_norm_in else None
        q_side = side_shares(record, layer, w_q, b_q, "q bias", queries, q_norm)  # (P, nq, D)
        k_side = side_shares(record, layer, w_k, b_k, "k bias", key, k_norm)  # (1, nk, D)
        per_query = torch.einsum("pqd,kd->pqk", q_side.rotated, k_side.rotated[0])  # (P, nq, nk)
        real = trace.scores[0, head, queries, 0]  # (P,)
        size = trace.q[0, head, queries].double().norm(dim=-1) * trace.keys[0, head, 0].double().norm()
        check_split("the sink's source pairs", per_query.sum((1, 2)), real, size, f"layer {layer} head {head}")
        weights = trace.weights[0, head, queries, 0]
        out.append(SinkAttribution(
            layer=layer, head=head, kv_head=kv_head,
            sink_mass=float(weights.double().mean()) if mass != mass else mass, queries=t - 1,
            query_sources=q_side.names, key_sources=k_side.names, pairs=per_query.mean(0),
            score=float(real.double().mean()), scale=float(trace.scale)))
    return out
