"""The story steps of the HTML page: for one (layer, head, query), every step of attention
with all of its values (long vectors and tables shortened, saying so), numbered as the
terminal numbers them (qkv.book.steps).

Shape legend: C embedding, H query heads, H_kv key/value heads, D head size, S keys.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from qkv.trace.record.export import plain, token_at
from qkv.trace.record.recorder import LayerTrace
from qkv.book.steps import context_meaning, step_heading, step_number

SHOWN_DIMS = 8  # a vector shows its first entries, then its length
SHOWN_ROWS = 64  # a step's table shows at most this many rows (one per token, or matrix row)


def fmt(values: list[float | None]) -> str:
    shown = ", ".join("-inf" if v is None else f"{v:.4f}" for v in values[:SHOWN_DIMS])
    more = f", … ({len(values)} in all)" if len(values) > SHOWN_DIMS else ""
    return f"[{shown}{more}]"


def _vector_rows(labels: list[str], rows: list[list[float | None]],
                 limit: int = SHOWN_ROWS) -> list[dict[str, str]]:
    """One row per vector, labelled; vectors longer than SHOWN_DIMS show their first entries
    and their length, tables longer than `limit` end with a row that says how many more."""
    shown = [{"label": label, "value": fmt(row)} for label, row in zip(labels[:limit], rows)]
    if len(rows) > limit:
        shown.append({"label": "…", "value": f"{len(rows) - limit} more rows ({len(rows)} in all)"})
    return shown


def _one(label: str, values: list[float | None]) -> list[dict[str, str]]:
    return [{"label": label, "value": fmt(values)}]


def _matrix_rows(name: str, matrix: Tensor) -> list[dict[str, str]]:
    """A projection (C, H*D or H_kv*D), one row per input dimension: in full for the book's
    3 x 2, its corner (as many rows as columns shown) for a real model's."""
    rows = plain(matrix[:SHOWN_ROWS])
    labels = [f"{name} row {i + 1}" for i in range(matrix.shape[0])]
    return _vector_rows(labels, rows + [[]] * (matrix.shape[0] - len(rows)), limit=SHOWN_DIMS)


def _shape(matrix: Tensor) -> str:
    return f"[{matrix.shape[0]}, {matrix.shape[1]}]"


def projections_shape(layer: LayerTrace) -> str:
    """Each projection's real shape: with grouped-query attention W_key and W_value are
    narrower than W_query (H_kv heads, not H)."""
    named = (("W_query", layer.W_query), ("W_key", layer.W_key), ("W_value", layer.W_value))
    if len({tuple(m.shape) for _, m in named}) == 1:
        return f"{_shape(layer.W_query)} each"
    return ", ".join(f"{name} {_shape(m)}" for name, m in named)


def _projections_meaning(layer: LayerTrace, *, book: bool) -> str:
    text = "Trainable projections: queries = x @ W_query, keys = x @ W_key, values = x @ W_value."
    if book:
        return text + " Drawn with torch.rand after torch.manual_seed, as the book does."
    h, h_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    text += f" All heads side by side ({h} × {d} columns for the queries"
    if h_kv != h:
        return text + (f", {h_kv} × {d} for the keys and the values: grouped-query attention, each "
                       f"key/value head shared by {h // h_kv} query heads), one row per input dimension.")
    return text + "), one row per input dimension."


def _step(step: str, shape: str, meaning: str, rows: list[dict[str, str]], name: str = "") -> dict[str, Any]:
    return {"number": step_number(step), "heading": step_heading(step, name), "shape": shape,
            "meaning": meaning, "rows": rows}


def story_steps(layer: LayerTrace, row: dict[str, Any], tokens: list[str], *, book: bool,
                query: int) -> list[dict[str, Any]]:
    """The steps for one (head, query), each with every value it has: one row per token,
    per matrix row or per vector. `query` indexes the layer's new tokens, from 0."""
    c = layer.x.shape[-1]
    d = layer.head_dim
    s_keys = layer.num_keys
    key_labels = [f"k({s + 1}) {token_at(tokens, s)}" for s in range(s_keys)]
    input_labels = [token_at(tokens, layer.cache_length + i) for i in range(layer.x.shape[1])]
    keys_rows = _vector_rows(key_labels, row["keys"])
    if layer.rope:
        new_keys = [f"k({layer.cache_length + i + 1}) {token_at(tokens, layer.cache_length + i)} before RoPE"
                    for i in range(len(row["keys_unrotated"]))]
        keys_rows = _vector_rows(new_keys, row["keys_unrotated"]) + keys_rows
    weights_rows = []
    for name, matrix in (("W_query", layer.W_query), ("W_key", layer.W_key), ("W_value", layer.W_value)):
        weights_rows += _matrix_rows(name, matrix)
    masked = not all(row["visible"])
    position, token = row["query"]["position"], row["query"]["token"]
    steps = [
        _step("inputs", f"[{layer.x.shape[1]}, {c}]", "One vector per token: the layer's input.",
              _vector_rows(input_labels, plain(layer.x[0])), " x"),
        _step("projections", projections_shape(layer), _projections_meaning(layer, book=book), weights_rows),
        _step("keys", f"[{s_keys}, {d}]", "One key per token the query may look at" + (
            f"; this head reads key/value head {row['kv_head']}, shared by query heads "
            f"{', '.join(map(str, layer.query_heads_of(row['kv_head'])))}."
            if layer.num_kv_heads != layer.num_heads else ".")
            + (" Before RoPE only the new tokens' keys exist; the cache keeps them rotated." if layer.rope else ""),
            keys_rows, " k"),
        _step("query", f"[{d}]", f"Head {row['head']}'s query for x({position}) = “{token}”"
              + (", rotated by RoPE for its position." if layer.rope else "."),
              (_one("before RoPE", row["query_unrotated"]) + _one("after RoPE", row["query_vector"]))
              if layer.rope else _one(f"q({position})", row["query_vector"]), " q"),
        _step("scores", f"[{s_keys}, {d}] → [{s_keys}]",
              "Multiply query and key component by component, add up: one score per key.",
              _vector_rows([f"q ⊙ k({s + 1}) {token_at(tokens, s)}" for s in range(s_keys)], row["products"])
              + _one("q · k", row["scores"]), ": q ⊙ k, then q · k"),
        _step("scaled", f"[{s_keys}]", f"Divide by sqrt(d_k) = sqrt({d}) so the softmax does not saturate"
              + ("; keys the query may not see (the mask) get -inf." if layer.causal or masked else ".")
              + (f" This is a local layer: a query sees only its last {layer.window} keys (a sliding "
                 "window), so keys before that get -inf too." if layer.window is not None else ""),
              _one(f"q · k / sqrt({d})", row["scaled_scores"]), " scores"),
        _step("weights", f"[{s_keys}]", "Softmax: positive, summing to 1.", _one("softmax", row["weights"]),
              ": softmax"),
        _step("values", f"[{s_keys}, {d}]", "What each token hands over once it is attended to.",
              _vector_rows([f"v({s + 1}) {token_at(tokens, s)}" for s in range(s_keys)], row["values"]), " v"),
        _step("context", f"[{d}]", "The weights mix the value vectors, context = weights @ values: "
              + context_meaning(token, masked=masked), _one("context", row["context"]), " vector"),
    ]
    if layer.num_heads > 1 or layer.kind not in ("book example", "SelfAttention_v1", "SelfAttention_v2",
                                                 "CausalAttention"):
        steps.append(_step(
            "output", f"[{layer.concat.shape[-1]}] → [{layer.output.shape[-1]}]",
            f"The {layer.num_heads} heads' contexts are concatenated and projected back; the trace "
            "checked that this reproduces the module's real output.",
            _one("output", plain(layer.output[0, layer.query_slot(query)]))))
    return steps
