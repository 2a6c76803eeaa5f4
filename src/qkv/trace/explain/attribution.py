"""Why this key? The exact split of one attention score into its sources and its RoPE pairs.

    result = attribute(model, input_ids, layer=3, head=4, query=11, keys=[0, 7])
    result.top_pairs(key=7)        # (query source, key source, term), largest first
    result.to_json()

Why the split is exact. The score of query i against key j in one head is q_i · k_j, and
everything between the residual stream and that dot product is linear once the
normalisation scales of the two tokens are fixed at the values the real forward used:
- the residual stream r_p at position p is a sum of what wrote it (`qkv.trace.record.residual`):
  r_p = sum_s c_s(p) over the token embedding (and GPT-2's position embedding), each
  earlier head's output (concat_h @ W_o,h^T), each earlier o_proj bias and MLP output;
- RMSNorm at p is w ⊙ r_p · a_p with a_p = 1/sqrt(mean(r_p²) + eps): with a_p fixed it is
  linear, so w ⊙ c_s(p) · a_p per source; LayerNorm is w ⊙ (r_p - mean(r_p)) · a_p + b with
  a_p = 1/sqrt(var(r_p) + eps): the mean is linear too, so each source is centred by its own
  mean, and the shift b becomes a source of its own (it enters both sides);
- the projections are matrices (q = n @ W_q + b_q): a bias is one more source;
- q/k-norm (Qwen3) multiplies each head's vector by its own per-token scale (fixed from the
  forward) and a weight: linear again;
- RoPE rotates each channel pair (i, i + D/2) by an angle of the position: linear.
So q_i = sum_s q_s and k_j = sum_t k_t, and q_i · k_j = sum_{s,t} q_s · k_t exactly: one
term per (query source, key source) pair. The same dot product also splits over RoPE
pairs: pair f contributes q[f]k[f] + q[f+D/2]k[f+D/2], which for the rotated vectors is the
unrotated pair's content turned by the angle (i - j) · inv_freq[f]; the unrotated terms
(the score RoPE would give at distance 0) are shown next to them.

The scales a_p and the q/k-norm scales are computed from the real inputs of those norms
(forward pre-hooks), the sources are the real module outputs, and the terms are summed in
float64. Every split is then checked against the model's own float32 score (recorded by
`qkv.trace`, itself checked against the module's output): a split that misses by more
than 1e-5 (of max(1, |q||k|), see TOLERANCE) raises `TraceMismatchError`; nothing is
drawn from a split that does not add up.

Shape legend: T tokens, S selected keys, C embedding, H query heads, H_kv key/value heads,
D head size, n sources (nq query side, nk key side), G query heads sharing a key head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.rope import rotate_half
from qkv.errors import QkvError
from qkv.trace.record.views import html_view
from qkv.trace.record.recorder import LayerTrace, TraceMismatchError, recording
from qkv.trace.record.residual import (ResidualLayout, SourceRecord, norm_kind, recording_sources,
                                residual_layout)

# The split must add up to the model's float32 score within TOLERANCE · max(1, |q||k|):
# 1e-5 absolute for small vectors, else 1e-5 of |q||k|, the size a float32 dot product (and
# the float32 projections before it) rounds with. On real SmolLM2 (|q||k| ~ 200-350) the
# model's own float32 projections differ from the exact float64 sum by ~1e-7 of |q||k|.
TOLERANCE = 1e-5
# The (S, nq, nk) pair terms are bounded before they are allocated.
MAX_PAIR_BYTES = 512 * 2**20


@dataclass
class ForwardRecord:
    """One forward of one text: every source of the residual stream and the trace of the
    target layers (all heads, the chosen queries)."""

    model: nn.Module
    layout: ResidualLayout
    sources: SourceRecord
    traces: dict[int, LayerTrace]
    tokens: list[str] | None
    length: int


@torch.no_grad()
def record_forward(model: nn.Module, input_ids: Tensor, *, layers: Sequence[int],
                   queries: Sequence[int] | None = None, tokens: Sequence[str] | None = None) -> ForwardRecord:
    """Run `input_ids` (1, T) once, recording the sources and the target layers' scores."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise QkvError(f"score attribution explains one text: input_ids must be (1, T), got {tuple(input_ids.shape)}")
    if model.training:
        raise QkvError("the model is in training mode; call .eval() before attributing scores")
    layout = residual_layout(model)
    count = len(layout.blocks)
    chosen = sorted({_index(l, count, "layer") for l in layers})
    t = int(input_ids.shape[1])
    picked = None if queries is None else sorted({_index(q, t, "query position") for q in queries})
    with recording_sources(model, layout, chosen) as sources, \
            recording(model, layer=chosen, head=None, query=picked) as traces:
        model(input_ids)
    return ForwardRecord(model, layout, sources, {i: calls[-1] for i, calls in traces.items()},
                         None if tokens is None else list(tokens), t)


def _index(value: int, count: int, what: str) -> int:
    if not -count <= int(value) < count:
        raise QkvError(f"{what} {value} is out of range: there are {count} (counted from 0 here: 0..{count - 1})")
    return int(value) % count


@dataclass
class ScoreAttribution:
    """The exact split of one query row's scores (selected keys) in one head."""

    layer: int
    head: int
    kv_head: int
    query: int  # position, from 0
    keys: list[int]  # positions, from 0
    tokens: list[str] | None
    scale: float
    query_sources: list[str]
    key_sources: list[str]
    pairs: Tensor  # (S, nq, nk) float64: the raw score's terms, q_s · k_t
    scores: Tensor  # (S,) the model's q · k (float32)
    weights: Tensor  # (S,) the model's softmax weight of each key in this query row
    group_heads: list[int]  # query heads that read the same key/value head
    group_scores: Tensor  # (G, S) each of them: q · k of these keys
    group_weights: Tensor  # (G, S)
    wavelengths: Tensor | None  # (D/2,) tokens per turn of each RoPE pair; None without RoPE
    bands: Tensor | None  # (S, D/2) each pair's share of the score, rotated (sums to the score)
    bands_unrotated: Tensor | None  # (S, D/2) the same pairs before RoPE (content alone)
    angles: Tensor | None  # (S, D/2) (query - key) · inv_freq: the turn between the two
    extras: dict[str, Any] = field(default_factory=dict)

    def slot(self, key: int) -> int:
        if key not in self.keys:
            raise QkvError(f"key position {key} was not attributed; attributed: {self.keys}")
        return self.keys.index(key)

    def query_totals(self, key: int) -> Tensor:
        """(nq,) each query source's share of the score against `key` (summed over key sources)."""
        return self.pairs[self.slot(key)].sum(1)

    def key_totals(self, key: int) -> Tensor:
        """(nk,) each key source's share (summed over query sources)."""
        return self.pairs[self.slot(key)].sum(0)

    def top_pairs(self, key: int, count: int = 10) -> list[tuple[str, str, float]]:
        """The `count` largest terms by size: (query source, key source, raw term)."""
        terms = self.pairs[self.slot(key)]  # (nq, nk)
        flat = terms.flatten()
        order = flat.abs().argsort(descending=True)[:count]
        nk = terms.shape[1]
        return [(self.query_sources[int(i) // nk], self.key_sources[int(i) % nk], float(flat[i])) for i in order]

    def coarse(self, key: int) -> tuple[list[str], list[str], Tensor]:
        """The pair terms with each layer's heads (and o_proj bias) summed: (names, names, (nq', nk'))."""
        qn, kn, terms = self.coarse_all()
        return qn, kn, terms[self.slot(key)]

    def coarse_all(self) -> tuple[list[str], list[str], Tensor]:
        """`coarse` for every attributed key: (names, names, (S, nq', nk'))."""
        qn, qm = _coarse_map(self.query_sources)
        kn, km = _coarse_map(self.key_sources)
        return qn, kn, qm @ self.pairs @ km.T

    def top_share(self, key: int, count: int = 3) -> float:
        """Share of the score's total term size (sum of |terms|) held by the `count` largest terms."""
        terms = self.pairs[self.slot(key)].abs().flatten()
        return float(terms.topk(min(count, terms.numel())).values.sum() / terms.sum().clamp_min(1e-300))

    def token(self, position: int) -> str:
        return self.tokens[position] if self.tokens is not None else str(position + 1)

    def to_json(self, top: int = 10, only: Sequence[int] | None = None) -> dict[str, Any]:
        """Every number a reader needs, positions counted from 1 as the CLI counts them;
        `only`: the keys (from 0) to include (default: every attributed key)."""
        out: dict[str, Any] = {
            "layer": self.layer, "head": self.head, "kv_head": self.kv_head,
            "query": {"position": self.query + 1, "token": self.token(self.query)},
            "scale": self.scale, "query_sources": self.query_sources, "key_sources": self.key_sources,
            "shared_by": self.group_heads, "keys": [],
        }
        for s, key in enumerate(self.keys):
            if only is not None and key not in only:
                continue
            entry: dict[str, Any] = {
                "position": key + 1, "token": self.token(key), "score": float(self.scores[s]),
                "scaled": float(self.scores[s]) * self.scale, "weight": float(self.weights[s]),
                "sum_of_terms": float(self.pairs[s].sum()),
                "top_pairs": [{"query_source": q, "key_source": k, "term": t, "scaled": t * self.scale}
                              for q, k, t in self.top_pairs(key, top)],
                "query_totals": [float(v) for v in self.query_totals(key)],
                "key_totals": [float(v) for v in self.key_totals(key)],
                "group": [{"head": h, "score": float(self.group_scores[g, s]),
                           "weight": float(self.group_weights[g, s])} for g, h in enumerate(self.group_heads)],
            }
            if self.bands is not None:
                entry["rope_pairs"] = [
                    {"pair": f, "wavelength": float(self.wavelengths[f]), "rotated": float(self.bands[s, f]),
                     "unrotated": float(self.bands_unrotated[s, f]), "angle": float(self.angles[s, f])}
                    for f in range(self.bands.shape[1])]
            out["keys"].append(entry)
        return out

    def _repr_html_(self) -> str:
        """Jupyter's view: the split as tables and bars (qkv.trace.render.attribution_view)."""
        return html_view(self)


def _coarse_map(names: list[str]) -> tuple[list[str], Tensor]:
    """Sources -> layer-level groups ('L3.H2', 'L3.o_bias' -> 'L3.attn') and the (n', n) 0/1 map."""
    groups: list[str] = []
    rows: list[int] = []
    for name in names:
        head = name.split(".")[0]
        label = f"{head}.attn" if name.startswith("L") and not name.endswith(".mlp") else name
        if label not in groups:
            groups.append(label)
        rows.append(groups.index(label))
    matrix = torch.zeros(len(groups), len(names), dtype=torch.float64)
    matrix[rows, range(len(names))] = 1.0
    return groups, matrix


@dataclass
class SideShares:
    names: list[str]
    rotated: Tensor  # (P, n, D) float64, what meets the other side
    unrotated: Tensor  # (P, n, D) before RoPE


def norm_scales(record: ForwardRecord, layer: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """(a (P, 1), w (C,), shift (C,) or None, centred): the attention norm at these tokens,
    its scale a_p from the real residual that entered it."""
    norm = record.layout.blocks[layer].attn_norm
    r = record.sources.residual[layer][positions].double()  # (P, C)
    if norm_kind(norm) == "rms":
        a = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + norm.eps)
        return a, norm.weight.detach().double(), None, False
    a = torch.rsqrt(r.var(-1, unbiased=False, keepdim=True) + norm.eps)
    return a, norm.scale.detach().double(), norm.shift.detach().double(), True


def side_shares(record: ForwardRecord, layer: int, matrix: Tensor, bias: Tensor | None, bias_name: str,
          positions: Tensor, qk_norm: tuple[nn.Module, Tensor] | None) -> SideShares:
    """Every source's share of the queries (or keys) of one head at `positions`.

    matrix (C, D): the head's columns of W_q (or W_k) in x @ W form; bias (D,) its bias.
    """
    a, w, shift, centred = norm_scales(record, layer, positions)
    m = w[:, None] * matrix.double()  # (C, D): the norm's weight folded into the projection
    if centred:
        m = m - m.mean(0, keepdim=True)  # centring a source then projecting = projecting with centred rows
    p, d = positions.numel(), m.shape[1]
    names: list[str] = []
    parts: list[Tensor] = []  # each (P, k, D)

    def add(name: str | list[str], value: Tensor) -> None:
        names.extend([name] if isinstance(name, str) else name)
        parts.append(value if value.dim() == 3 else value.unsqueeze(1))

    src = record.sources
    for name, _ in record.layout.embeddings:
        add(name, a * (src.embeddings[name][positions].double() @ m))
    for l in range(layer):
        attention = record.layout.blocks[l].attention
        h_l, d_l = attention.num_heads, attention.head_dim
        concat = src.concat64(l)[positions].view(p, h_l, d_l)  # (P, H, D_l)
        w_o = src.o_weight64(l)  # (C, H, D_l)
        if 2 * p > d:  # many positions: fold W_o into the projection once
            folded = (w_o.permute(1, 2, 0) @ m)  # (H, D_l, C) @ (C, D) -> (H, D_l, D)
            heads = (concat.transpose(0, 1) @ folded).transpose(0, 1)  # (H, P, D_l) @ (H, D_l, D) -> (P, H, D)
        else:
            heads = torch.einsum("phd,chd->phc", concat, w_o) @ m  # (P, H, D)
        add([f"L{l}.H{h}" for h in range(h_l)], a.unsqueeze(-1) * heads)
        o_bias = src.o_bias(l)
        if o_bias is not None:
            add(f"L{l}.o_bias", a * (o_bias.double() @ m))
        add(f"L{l}.mlp", a * (src.mlp_out[l][positions].double() @ m))
    if shift is not None:
        add("norm shift", (shift @ matrix.double()).expand(p, d))
    if bias is not None:
        add(bias_name, bias.double().expand(p, d))
    unrotated = torch.cat(parts, dim=1)  # (P, n, D)
    if qk_norm is not None:
        module, pre = qk_norm  # pre: (P, D) the real input of q_norm / k_norm for this head
        pre = pre.double()
        scale = torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + module.eps)  # (P, 1)
        unrotated = unrotated * (scale.unsqueeze(-1) * module.weight.detach().double())
    trace = record.traces[layer]
    if trace.cos is None:
        return SideShares(names, unrotated, unrotated)
    cos = trace.cos[positions].double().unsqueeze(1)  # (P, 1, D)
    sin = trace.sin[positions].double().unsqueeze(1)
    return SideShares(names, unrotated * cos + rotate_half(unrotated) * sin, unrotated)


def check_split(what: str, split: Tensor, real: Tensor, scale: Tensor, where: str) -> None:
    """split (float64) must equal real (float32) within TOLERANCE · max(1, scale)."""
    error = (split - real.double()).abs()
    bound = TOLERANCE * torch.as_tensor(scale, dtype=torch.float64).clamp_min(1.0)
    if bool((error > bound).any()):
        worst = int((error - bound).argmax())
        raise TraceMismatchError(
            f"{where}: {what} sums to {float(split.flatten()[worst]):.7g}, the model's score is "
            f"{float(real.flatten()[worst]):.7g} (off by {float(error.flatten()[worst]):.2g}); "
            "the split is not exact, so it is not shown")


def attribute_recorded(record: ForwardRecord, *, layer: int, head: int, query: int,
                       keys: Sequence[int] | None = None) -> ScoreAttribution:
    """The split of head `head`'s scores of query `query` against `keys` (default: every
    key it sees), at `layer`, from a recorded forward. Positions count from 0."""
    if layer not in record.traces:
        raise QkvError(f"layer {layer} was not recorded; recorded: {sorted(record.traces)}")
    trace = record.traces[layer]
    if trace.cache_length:
        raise QkvError("score attribution explains one whole text: record it without a KV cache "
                       "(outside a decode session)")
    attention = record.layout.blocks[layer].attention
    h_all, d = attention.num_heads, attention.head_dim
    head = _index(head, h_all, "head")
    query = _index(query, record.length, "query position")
    if query not in trace.queries:
        raise QkvError(f"query position {query} was not recorded; recorded: {trace.queries}")
    keys = list(range(query + 1)) if keys is None else [_index(k, record.length, "key position") for k in keys]
    late = [k for k in keys if k > query]
    if late:
        raise QkvError(f"key position {late[0] + 1} comes after the query ({query + 1}): the causal mask hides it")
    kv_head = head // (h_all // attention.num_kv_heads)
    (w_q, b_q), (w_k, b_k) = head_projections(attention, head, kv_head)
    qpos, kpos = torch.tensor([query]), torch.tensor(keys)
    src = record.sources
    q_norm = (attention.q_norm, src.q_norm_in[layer][qpos, head]) if layer in src.q_norm_in else None
    k_norm = (attention.k_norm, src.k_norm_in[layer][kpos, kv_head]) if layer in src.k_norm_in else None
    sources = len(record.layout.embeddings) + layer * (h_all + 2) + 2  # an upper bound per side
    if len(keys) * sources * sources * 8 > MAX_PAIR_BYTES:  # (S, nq, nk) float64
        raise QkvError(f"attributing {len(keys)} keys at layer {layer} needs more than "
                       f"{MAX_PAIR_BYTES // 2**20} MiB; choose fewer keys")
    q_side = side_shares(record, layer, w_q, b_q, "q bias", qpos, q_norm)
    k_side = side_shares(record, layer, w_k, b_k, "k bias", kpos, k_norm)
    q_vec = q_side.rotated[0]  # (nq, D)
    pairs = torch.einsum("qd,skd->sqk", q_vec, k_side.rotated)  # (S, nq, nk)

    slot = trace.query_slot(query)
    real = trace.scores[0, head, slot, kpos]  # (S,) the model's q · k
    where = f"layer {layer} head {head} query {query + 1}"
    q_real, k_real = trace.q[0, head, slot].double(), trace.keys[0, head, kpos].double()  # (D,), (S, D)
    size = q_real.norm() * k_real.norm(dim=-1)  # (S,) |q||k|: the size float32 rounding scales with
    check_split("the reconstructed query", q_vec.sum(0), trace.q[0, head, slot], q_real.abs().max(), where)
    check_split("the reconstructed keys", k_side.rotated.sum(1), trace.keys[0, head, kpos],
           k_real.abs().amax(-1, keepdim=True), where)
    check_split("the source pairs", pairs.sum((1, 2)), real, size, where)

    group = attention.query_heads_of(kv_head)
    result = ScoreAttribution(
        layer=layer, head=head, kv_head=kv_head, query=query, keys=keys, tokens=record.tokens,
        scale=float(trace.scale), query_sources=q_side.names, key_sources=k_side.names, pairs=pairs,
        scores=real.clone(), weights=trace.weights[0, head, slot, kpos].clone(), group_heads=group,
        group_scores=trace.scores[0, group, slot][:, kpos].clone(),
        group_weights=trace.weights[0, group, slot][:, kpos].clone(),
        wavelengths=None, bands=None, bands_unrotated=None, angles=None,
    )
    if trace.cos is not None:
        half = d // 2
        rotated = q_vec.sum(0) * k_side.rotated.sum(1)  # (S, D)
        plain = q_side.unrotated[0].sum(0) * k_side.unrotated.sum(1)  # (S, D)
        result.bands = rotated[:, :half] + rotated[:, half:]  # (S, D/2)
        result.bands_unrotated = plain[:, :half] + plain[:, half:]
        inv_freq = _inverse_frequencies(record.model, half)
        result.wavelengths = 2 * math.pi / inv_freq
        result.angles = (query - kpos.double()).unsqueeze(1) * inv_freq  # (S, D/2)
        check_split("the RoPE pairs", result.bands.sum(1), real, size, where)
    return result


def _inverse_frequencies(model: nn.Module, half: int) -> Tensor:
    rotary = model.rotary_embedding()
    inv_freq = rotary.inv_freq.double()
    if inv_freq.numel() != half:
        raise QkvError(f"the model's RoPE has {inv_freq.numel()} pairs, its heads {half}")
    return inv_freq


def head_projections(attention: nn.Module, head: int, kv_head: int) -> tuple[tuple[Tensor, Tensor | None], ...]:
    """((W_q (C, D), b_q), (W_k (C, D), b_k)) of one query head and its key head, as x @ W + b."""
    from qkv.trace.record.adapters import projection_parts

    d = attention.head_dim
    (wq, bq), (wk, bk), _ = projection_parts(attention)  # (C, H*D), (C, H_kv*D)
    q_cols, k_cols = slice(head * d, (head + 1) * d), slice(kv_head * d, (kv_head + 1) * d)
    return ((wq[:, q_cols], None if bq is None else bq[q_cols]),
            (wk[:, k_cols], None if bk is None else bk[k_cols]))


def attribute(model: nn.Module, input_ids: Tensor, *, layer: int, head: int, query: int,
              keys: Sequence[int] | None = None, tokens: Sequence[str] | None = None) -> ScoreAttribution:
    """Run `input_ids` (1, T) once and split head `head`'s scores of query `query` against
    `keys` (default: all it sees) at `layer` into source pairs and RoPE pairs.
    Positions count from 0. Raises TraceMismatchError if a split does not add up."""
    record = record_forward(model, input_ids, layers=[layer], queries=[query], tokens=tokens)
    count = len(record.layout.blocks)
    return attribute_recorded(record, layer=layer % count, head=head, query=query, keys=keys)
