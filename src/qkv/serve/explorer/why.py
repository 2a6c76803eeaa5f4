"""The explorer's "why this key?": click a key's row to see its score split exactly.

POST /explorer/why {"text", "layer", "head", "query" (from 1), "key" (from 1), "top"
(1..50, default 12)} answers `ScoreAttribution.to_json` for that one key (what
`qkv explain --why QUERY:KEY --json` prints under "why"), plus "served": the served
model's own score and weight of that key, its precision, and what the split is of
("split_of": "served" or "float weights"). The split runs on the engine thread, between
decode steps, like the trace.

What is split, by precision (decided here; the split is exact or it is not shown):
- float32 and int8: the served model itself. int8's layers multiply float activations by the
  weights their int8 values stand for, which is linear, so the split adds up to the served score.
- int4 (SmolLM2's default): int4's layers round their activations to 8 bits per block of 32,
  which is not linear, so no split adds up to the served score. The split is then of the
  float weights the int4 blocks stand for (qkv.serve.explorer.float_weights), labelled so
  ("split_of": "float weights"), with the served int4 score and weight beside it: the same
  weights, the difference being int4's rounding of the activations. Recomputing the served
  arithmetic is never faked to match.
- bfloat16: every operation rounds to 8 bits of mantissa; no stand-in would be the same
  model without copying it to float32, so the answer is 409 saying to serve with
  --dtype float32 (or int8 / int4). A split that still does not add up (a model type whose
  arithmetic the attribution does not follow) is the same 409, never a 500.

`with_why(page)` adds the click handler to the explorer page: one script, appended, that
listens for clicks on the keys table and shows the largest terms under it (every text set
with textContent), so the page itself is left as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qkv.errors import QkvError
from qkv.serve.api.json_body import read_json_body
from qkv.serve.api.schemas import ApiError
from qkv.serve.explorer.float_weights import float_weights
from qkv.serve.explorer.host import ExplorerHost
from qkv.serve.engine.text import display_tokens


MAX_WHY_TOKENS = 512
MAX_TOP = 50
SPLIT_PRECISIONS = ("float32", "int8", "int4")  # what the split follows (module docstring)
TO_SPLIT = "serve with --dtype float32 (or int8 / int4) to see the exact split"


def _int(body: dict[str, Any], name: str, default: int | None) -> int:
    value = body.get(name, default)
    if value is None or not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    return value


def _not_split(message: str) -> ApiError:
    return ApiError(409, message, code="split_not_exact")


class ExplorerWhy:
    def __init__(self, api: ExplorerHost) -> None:
        self.api = api

    async def why(self, request: Request) -> Response:
        from qkv.trace.record.recorder import TraceMismatchError

        self.api.check_key(request)
        body = await read_json_body(request, self.api.limits.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str) or not body["text"].strip():
            raise ApiError(400, "'text' must be a non-empty string", param="text")
        layer, head = _int(body, "layer", 0), _int(body, "head", 0)
        query, key, top = _int(body, "query", None), _int(body, "key", None), _int(body, "top", 12)
        if not 1 <= top <= MAX_TOP:
            raise ApiError(400, f"'top' must be between 1 and {MAX_TOP}, got {top}", param="top")
        precision = self.api.served.precision
        if precision not in SPLIT_PRECISIONS:
            raise _not_split(f"this server runs {precision}, whose scores no exact split follows; {TO_SPLIT}")
        future = self.api.served.engine.call(lambda: self._split(body["text"], layer, head, query, key, top))
        try:
            return JSONResponse(await asyncio.wrap_future(future))
        except QkvError as error:
            raise ApiError(400, str(error)) from None
        except TraceMismatchError as error:
            raise _not_split(f"{error} ({precision}); {TO_SPLIT}") from None

    def _split(self, text: str, layer: int, head: int, query: int, key: int, top: int) -> dict[str, Any]:
        from qkv.trace import trace
        from qkv.trace.explain.attribution import attribute

        served = self.api.served
        ids = served.tokenizer.encode(text).ids
        if not 1 <= len(ids) <= MAX_WHY_TOKENS:
            raise QkvError(f"the text has {len(ids)} tokens; the split takes 1 to {MAX_WHY_TOKENS}")
        count = len(list(served.model.attention_layers()))
        if not 0 <= layer < count:
            raise QkvError(f"layer {layer} is out of range: the model has {count} layers (0..{count - 1})")
        # Positions count from 1, as /explorer/trace's (layers and heads from 0).
        if not 1 <= query <= len(ids) or not 1 <= key <= query:
            raise QkvError(f"query {query} and key {key}: give 1 <= key <= query <= {len(ids)} (positions from 1)")
        tokens = display_tokens(served.tokenizer, ids)
        input_ids = torch.tensor([ids])
        with float_weights(served.model) as stand_ins:  # int4's layers: the float weights they stand for
            result = attribute(served.model, input_ids, layer=layer, head=head, query=query - 1,
                               keys=[key - 1], tokens=tokens)
        answer = result.to_json(top=top)
        if stand_ins:  # the served model's own score, as /explorer/trace records it
            recorded = trace(served.model, input_ids, layer=[layer], head=[head], query=[query - 1]).layer(layer)
            slot, row = recorded.head_slot(head), recorded.query_slot(query - 1)
            score, weight = float(recorded.scores[0, slot, row, key - 1]), float(recorded.weights[0, slot, row, key - 1])
        else:
            score, weight = float(result.scores[0]), float(result.weights[0])
        answer["split_of"] = "float weights" if stand_ins else "served"
        answer["served"] = {"precision": served.precision, "score": score, "weight": weight}
        return answer


WHY_SCRIPT = r"""
(() => {
  const box = document.createElement("div"); box.id = "why";
  $("keys").insertAdjacentElement("afterend", box);
  $("keys").addEventListener("click", async e => {
    const tr = e.target.closest("tr.key"); if (!tr || !last) return;
    const body = {text: $("text").value, layer: last.layer, head: last.head,
                  query: last.query.position, key: tr.sectionRowIndex + 1, top: 12};
    box.replaceChildren(); const note = document.createElement("p"); note.className = "muted";
    note.textContent = "splitting the score of key " + body.key + "…"; box.appendChild(note);
    const r = await fetch("/explorer/why", {method: "POST", headers: headers(), body: JSON.stringify(body)});
    const d = await r.json();
    if (!r.ok) { note.textContent = d.error ? d.error.message : r.statusText; return; }
    const k = d.keys[0];
    const of = d.split_of === "served" ? "" : " Split of the float weights that " + d.served.precision +
      "'s blocks stand for; the served " + d.served.precision + " model scores it " + fmt(d.served.score) +
      " (weight " + fmt(d.served.weight) + ").";
    note.textContent = "why query " + d.query.position + " \u201c" + d.query.token + "\u201d looks at key " +
      k.position + " \u201c" + k.token + "\u201d: score " + fmt(k.score) + " = the sum of its terms " +
      fmt(k.sum_of_terms) + " (exact)." + of + " Largest terms:";
    const table = document.createElement("table"); table.className = "why-terms";
    const head = document.createElement("tr"); ["query source", "key source", "term", "scaled"].forEach(t => {
      const th = document.createElement("th"); th.textContent = t; head.appendChild(th); });
    table.appendChild(head);
    k.top_pairs.forEach(p => { const row = document.createElement("tr"); cell(row, p.query_source, "tok");
      cell(row, p.key_source, "tok"); cell(row, fmt(p.term)); cell(row, fmt(p.scaled)); table.appendChild(row); });
    box.appendChild(table);
  });
})();
"""


def with_why(page: str) -> str:
    """The explorer page with the click-to-split script appended to its own script."""
    marker = "</script></body>"
    if marker not in page:
        raise ValueError("the explorer page has no closing script to extend")
    return page.replace(marker, WHY_SCRIPT + marker, 1)
