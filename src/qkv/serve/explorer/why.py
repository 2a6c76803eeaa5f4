"""The explorer's "why this key?": click a key's row to see its score split exactly.

POST /explorer/why {"text", "layer", "head", "query" (from 1), "key" (from 1), "top"
(1..50, default 12)} answers `ScoreAttribution.to_json` for that one key (what
`qkv explain --why QUERY:KEY --json` prints under "why"). The split runs on the engine
thread, between decode steps, like the trace.

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
from qkv.serve.explorer.host import ExplorerHost
from qkv.serve.engine.text import display_tokens


MAX_WHY_TOKENS = 512
MAX_TOP = 50


def _int(body: dict[str, Any], name: str, default: int | None) -> int:
    value = body.get(name, default)
    if value is None or not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(422, f"'{name}' must be an integer", param=name)
    return value


class ExplorerWhy:
    def __init__(self, api: ExplorerHost) -> None:
        self.api = api

    async def why(self, request: Request) -> Response:
        self.api.check_key(request)
        body = await read_json_body(request, self.api.limits.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str) or not body["text"].strip():
            raise ApiError(422, "'text' must be a non-empty string", param="text")
        layer, head = _int(body, "layer", 0), _int(body, "head", 0)
        query, key, top = _int(body, "query", None), _int(body, "key", None), _int(body, "top", 12)
        if not 1 <= top <= MAX_TOP:
            raise ApiError(400, f"'top' must be between 1 and {MAX_TOP}, got {top}", param="top")
        future = self.api.served.engine.call(lambda: self._split(body["text"], layer, head, query, key, top))
        try:
            return JSONResponse(await asyncio.wrap_future(future))
        except QkvError as error:
            raise ApiError(400, str(error)) from None

    def _split(self, text: str, layer: int, head: int, query: int, key: int, top: int) -> dict[str, Any]:
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
        result = attribute(served.model, torch.tensor([ids]), layer=layer, head=head, query=query - 1,
                           keys=[key - 1], tokens=tokens)
        return result.to_json(top=top)


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
    note.textContent = "why query " + d.query.position + " \u201c" + d.query.token + "\u201d looks at key " +
      k.position + " \u201c" + k.token + "\u201d: score " + fmt(k.score) + " = the sum of its terms " +
      fmt(k.sum_of_terms) + " (exact); largest terms:";
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
