"""One self-contained HTML page that tells attention's story with the traced numbers.

Everything is inline: the style, the script, the data (JSON in a non-executable script
element) and the figures (PNG data URIs), so the page makes no network request when
opened, online or off. The story walks through the steps for one (layer, head, query)
with its numbers and figures; the explorer lets the reader pick the query token, hover a
key to read its score and weight, and switch head and layer among those recorded.

Text typed by the user (the prompt, hence the tokens) is escaped by Jinja's autoescape in
the markup and by JSON escaping (`<`, `>`, `&`) in the data; the script writes it with
textContent only, never as markup.

Shape legend: S keys, D head size.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

from jinja2 import Environment
from torch import Tensor

from qkv.errors import QkvError
from qkv.trace.explain.analysis import ALIKE
from qkv.trace.record.export import layer_summary, query_row, token_at
from qkv.trace.record.generation import CacheStep
from qkv.trace.render.html_analysis import trace_analyses
from qkv.trace.render.html_story import SHOWN_DIMS, story_steps
from qkv.trace.render.png import layer_figures, render_pngs, write_atomic
from qkv.trace.record.recorder import LayerTrace, Trace

_SHOWN_DIMS = SHOWN_DIMS


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _safe_json(value: Any) -> str:
    """JSON that cannot end the <script> element it sits in, whatever the tokens say."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _rounded(t: Tensor) -> list[float | None]:
    """The explorer shows 4 decimals: round once, from the recorded value, to keep the page
    small (rounding twice could change the last digit shown)."""
    return [round(v, 4) if math.isfinite(v) else None for v in t.float().tolist()]


def _explorer_rows(layer: LayerTrace) -> dict[str, Any]:
    """For each recorded head and query: the per-key numbers the explorer shows."""
    rows: dict[str, Any] = {}
    for slot, head in enumerate(layer.heads):
        for row, query in enumerate(layer.queries):
            rows[f"{head}:{query}"] = {
                "scores": _rounded(layer.scores[0, slot, row]),
                "scaled_scores": _rounded(layer.scaled[0, slot, row]),
                "weights": _rounded(layer.weights[0, slot, row]),
                "visible": layer.mask[0, slot, row].tolist(),
                "outside_window": layer.outside_window(query),
                "kv_head": layer.kv_heads[slot],
                "context": _rounded(layer.context[0, slot, row, :_SHOWN_DIMS]),
                "context_dims": layer.head_dim,
            }
    return rows


_TEMPLATE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{{ title }}</title>
<style>
body { font: 15px/1.5 system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #1d2330; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ccd; }
code, .num { font-family: ui-monospace, monospace; }
table { border-collapse: collapse; margin: .5rem 0; }
td, th { padding: .15rem .6rem; text-align: right; border-bottom: 1px solid #eef; }
td.tok, th.tok { text-align: left; }
.tokens span, .qbtn { display: inline-block; margin: .1rem; padding: .1rem .45rem; border-radius: .3rem; background: #eef; }
.qbtn { border: 1px solid #99a; cursor: pointer; font: inherit; }
.qbtn.active { background: #c2185b; color: white; }
.bar { display: inline-block; height: .8rem; background: #ef6c00; vertical-align: middle; }
.masked { color: #999; }
#explorer tr.query td { background: #fde0ec; font-weight: bold; }
#detail { min-height: 1.6rem; padding: .3rem .6rem; background: #fff8e1; border-radius: .3rem; }
.heat span { display: inline-block; padding: .15rem .4rem; margin: .1rem; border-radius: .25rem; }
img { max-width: 100%; }
.step { margin: .4rem 0 1rem 0; }
table.values th { font-weight: normal; color: #556; padding-right: 1rem; }
table.values td, table.values th { border-bottom: none; padding-top: 0; padding-bottom: 0; }
.controls label { margin-right: 1rem; }
.scope { color: #556; font-style: italic; }
td.current, th.current { background: #fde0ec; }
#matrix td.cell { width: 1.6rem; height: 1.1rem; padding: 0; border: 1px solid #fff; }
#matrix tr.qrow { cursor: pointer; } #matrix tr.active th { color: #c2185b; }
#matrix th.ktok { writing-mode: vertical-rl; transform: rotate(180deg); font-weight: normal; font-size: .8rem; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<p>{{ subtitle }}</p>
<p class="tokens" id="story-tokens">{% for token in tokens %}<span>{{ token }}</span>{% endfor %}</p>

<h2>The story, step by step: layer {{ focus.layer }}, head {{ focus.head }}, query x({{ focus.query.position }}) = “{{ focus.query.token }}”</h2>
{% for step in steps %}
<div class="step" id="step-{{ step.number }}"><b>{{ step.heading }}</b> <span class="num">{{ step.shape }}</span><br>
{{ step.meaning }}
<table class="values">{% for r in step.rows %}<tr><th class="tok">{{ r.label }}</th><td class="num tok">{{ r.value }}</td></tr>{% endfor %}</table></div>
{% endfor %}
<table id="story-table">
<tr><th>#</th><th class="tok">key token</th><th>q · k</th><th>scaled</th><th>weight</th></tr>
{% for key in focus_keys %}
<tr><td>{{ key.number }}</td><td class="tok">{{ key.token }}</td><td class="num">{{ key.score }}</td><td class="num">{{ key.scaled }}</td><td class="num">{{ key.weight }}</td></tr>
{% endfor %}
</table>

{% for figure in figures %}
<h2>{{ figure.caption }}</h2>
<img alt="{{ figure.caption }}" src="{{ figure.uri }}">
{% endfor %}

<h2>Explore</h2>
<p>Pick the query token, hover a key to read its score and weight, switch head and layer.</p>
<div class="controls">
<label>layer <select id="layer-select"></select></label>
<label>head <select id="head-select"></select></label>
<span id="kv-note"></span>
</div>
<p id="scope-note" class="scope"></p>
<p id="query-buttons"></p>
<div id="detail">hover a key</div>
<p class="heat" id="heat-row"></p>
<table id="explorer"><thead><tr><th>#</th><th class="tok">key token</th><th>q · k</th><th>scaled</th><th>weight</th><th class="tok"></th></tr></thead><tbody></tbody></table>
<p>context = weights @ values = <code id="context-out"></code></p>
<p>Every recorded query of this head (rows) against the keys (columns); click a row to pick
that query, hover a cell for its numbers (colour: weight relative to the row's largest; dark: masked).</p>
<table id="matrix"></table>

{% if analysis %}
<h2>What the learned weights do (<span id="analysis-scope">layer {{ focus.layer }}</span>)</h2>
<p class="scope">This section follows the layer and head switch of the Explore section above.</p>
<p>Weight on the first token “{{ key_tokens[0] }}”, per head, averaged over the <span id="sink-queries"></span>
recorded queries that see more than it (an “attention sink” parks weight there; the story above is one query):</p>
<table id="sink-table"></table>
<div id="kv-section"><p>Grouped-query attention: the query heads that share each key/value head, and how alike they attend.
<span id="alike-note">{{ alike }}</span></p>
<table id="kv-groups"></table></div>
<p>Key length by position (counted from 1; mean over the key/value heads):</p>
<table id="key-norms"></table>
<div id="rope-section"><p id="rope-note"></p>
<table id="rope-table"></table></div>
{% endif %}

{% if generation %}
<h2>The KV cache while generating</h2>
<p>Each new token's query is scored against every cached key; the cache grows by one key per step.</p>
<table id="kv-steps"><tr><th>step</th><th class="tok">query token</th><th>cached keys</th><th class="tok">weights over the cache</th></tr>
{% for step in generation %}<tr><td>{{ loop.index }}</td><td class="tok">{{ step.token }}</td><td>{{ step.cached }} + 1</td>
<td class="tok heat">{% for w in step.weights %}<span title="{{ w.token }}: {{ '%.3f'|format(w.weight) }}" style="background: rgba(239,108,0,{{ '%.3f'|format(w.alpha) }})">{{ w.token }}</span>{% endfor %}</td></tr>{% endfor %}
</table>
{% endif %}

<script type="application/json" id="trace-data">{{ data_json|safe }}</script>
<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("trace-data").textContent);
  var state = { layer: data.focus.layer_slot, head: data.focus.head, query: data.focus.query };
  var el = function (id) { return document.getElementById(id); };
  var fmt = function (v) { return v === null ? "-inf" : v.toFixed(4); };
  function clear(node) { while (node.firstChild) { node.removeChild(node.firstChild); } }
  function option(select, value, label) {
    var o = document.createElement("option"); o.value = String(value); o.textContent = label; select.appendChild(o);
  }
  function layer() { return data.layers[state.layer]; }
  function token(position) { return position < data.tokens.length ? data.tokens[position] : "#" + (position + 1); }
  function fillControls() {
    var ls = el("layer-select"); clear(ls);
    data.layers.forEach(function (l, i) { option(ls, i, "layer " + l.layer + (l.window === null ? "" : " (local, window " + l.window + ")")); });
    ls.value = String(state.layer);
    var hs = el("head-select"); clear(hs);
    layer().heads.forEach(function (h) { option(hs, h, "head " + h); });
    if (layer().heads.indexOf(state.head) < 0) { state.head = layer().heads[0]; }
    hs.value = String(state.head);
    var qb = el("query-buttons"); clear(qb);
    qb.appendChild(document.createTextNode("query: "));
    layer().query_indices.forEach(function (q, i) {
      var b = document.createElement("button");
      b.className = "qbtn" + (q === state.query ? " active" : "");
      b.dataset.query = String(q);
      b.textContent = layer().queries[i] + " " + token(layer().cache_length + q);
      b.addEventListener("click", function () { state.query = q; fillControls(); render(); });
      qb.appendChild(b);
    });
  }
  function render() {
    var l = layer();
    if (l.query_indices.indexOf(state.query) < 0) { state.query = l.query_indices[l.query_indices.length - 1]; }
    var row = l.rows[state.head + ":" + state.query];
    el("kv-note").textContent = (l.num_kv_heads !== l.num_heads ? "reads key/value head " + row.kv_head +
      " (shared by " + (l.num_heads / l.num_kv_heads) + " query heads)" : "") +
      (l.window === null ? "" : (l.num_kv_heads !== l.num_heads ? "; " : "") + "a local layer: each query sees only its last " +
       l.window + " keys, itself included (a key before that is marked outside window)");
    var body = el("explorer").tBodies[0]; clear(body);
    var heat = el("heat-row"); clear(heat);
    var top = Math.max.apply(null, row.weights.concat([1e-12]));
    row.weights.forEach(function (w, s) {
      var tr = document.createElement("tr");
      tr.className = "key-row" + (row.visible[s] ? "" : " masked") + (s === l.cache_length + state.query ? " query" : "");
      tr.dataset.key = String(s);
      var hidden = row.outside_window[s] ? "(outside window)" : "(masked)";
      [String(s + 1), token(s), row.visible[s] ? fmt(row.scores[s]) : hidden, fmt(row.scaled_scores[s]), w.toFixed(4)]
        .forEach(function (text, c) { var td = document.createElement("td"); td.textContent = text; if (c === 1) { td.className = "tok"; } tr.appendChild(td); });
      var bar = document.createElement("td"); bar.className = "tok";
      var span = document.createElement("span"); span.className = "bar"; span.style.width = (w * 12).toFixed(2) + "rem";
      bar.appendChild(span); tr.appendChild(bar);
      var show = function () {
        el("detail").textContent = "key " + (s + 1) + " \u201c" + token(s) + "\u201d: q \u00b7 k = " +
          (row.visible[s] ? fmt(row.scores[s]) : hidden.slice(1, -1)) + ", scaled = " + fmt(row.scaled_scores[s]) + ", weight = " + w.toFixed(4);
      };
      tr.addEventListener("mouseenter", show);
      body.appendChild(tr);
      var cell = document.createElement("span"); cell.className = "heat-cell"; cell.dataset.key = String(s);
      cell.textContent = token(s); cell.title = "weight " + w.toFixed(4);
      cell.style.background = "rgba(239,108,0," + (w / top).toFixed(3) + ")";
      cell.addEventListener("mouseenter", show);
      heat.appendChild(cell);
    });
    el("context-out").textContent = "[" + row.context.map(fmt).join(", ") +
      (row.context_dims > row.context.length ? ", \u2026 (" + row.context_dims + " in all)" : "") + "]";
    renderMatrix();
    renderScope();
    renderAnalysis();
  }
  function renderMatrix() {
    var l = layer(), table = el("matrix"); clear(table);
    var head = document.createElement("tr"); head.appendChild(document.createElement("th"));
    var keys = l.rows[state.head + ":" + l.query_indices[0]].weights.length;
    for (var s = 0; s < keys; s++) {
      var th = document.createElement("th"); th.className = "ktok"; th.textContent = token(s); head.appendChild(th);
    }
    table.appendChild(head);
    l.query_indices.forEach(function (q) {
      var r = l.rows[state.head + ":" + q], top = Math.max.apply(null, r.weights.concat([1e-12]));
      var tr = document.createElement("tr"); tr.className = "qrow" + (q === state.query ? " active" : "");
      tr.dataset.query = String(q);
      var th = document.createElement("th"); th.className = "tok"; th.textContent = token(l.cache_length + q); tr.appendChild(th);
      r.weights.forEach(function (w, s) {
        var td = document.createElement("td"); td.className = "cell"; td.dataset.key = String(s);
        td.style.background = r.visible[s] ? "rgba(239,108,0," + (w / top).toFixed(3) + ")" : "#333";
        td.addEventListener("mouseenter", function () {
          el("detail").textContent = "query \u201c" + token(l.cache_length + q) + "\u201d, key " + (s + 1) + " \u201c" +
            token(s) + "\u201d: q \u00b7 k = " + (r.visible[s] ? fmt(r.scores[s]) : r.outside_window[s] ? "outside the window" : "masked") + ", weight = " + w.toFixed(4);
        });
        tr.appendChild(td);
      });
      tr.addEventListener("click", function () { state.query = q; fillControls(); render(); });
      table.appendChild(tr);
    });
  }
  function fillTable(id, rows) {
    var t = el(id); clear(t);
    rows.forEach(function (cells) {
      var tr = document.createElement("tr");
      cells.forEach(function (c, i) {
        var td = document.createElement(i === 0 ? "th" : "td");
        td.textContent = typeof c === "object" ? c.text : c;
        if (typeof c === "object" && c.cls) { td.className = c.cls; }
        tr.appendChild(td);
      });
      t.appendChild(tr);
    });
  }
  function renderScope() {
    var l = layer(), f = data.focus;
    var same = l.layer === f.layer && state.head === f.head;
    el("scope-note").textContent = same
      ? "The story and the figures above show this layer and head, for the query x(" + f.query_position + ")."
      : "The story and the figures above stay at layer " + f.layer + ", head " + f.head + ", query x(" +
        f.query_position + ") (rerun qkv explain with --layer " + l.layer + " --head " + state.head +
        " to draw them for this choice); this section and \u201cWhat the learned weights do\u201d follow the switch.";
  }
  function renderAnalysis() {
    var l = layer(), a = l.analysis;
    if (!a) { return; }
    el("analysis-scope").textContent = "layer " + l.layer + "; head " + state.head + " marked";
    el("sink-queries").textContent = String(a.sink_queries);
    var mark = function (h) { return h === state.head ? "num current" : "num"; };
    fillTable("sink-table", [["head"].concat(a.sink_share.map(function (p) { return {text: String(p[0]), cls: mark(p[0])}; })),
      ["mean weight on token 1"].concat(a.sink_share.map(function (p) { return {text: p[1].toFixed(3), cls: mark(p[0])}; }))]);
    el("kv-section").hidden = l.num_kv_heads === l.num_heads;
    var dash = function (v) { return v === null ? "-" : v.toFixed(3); };
    fillTable("kv-groups", [["kv head", "query heads", "alike within", "alike across"]].concat(a.kv_groups.map(function (g) {
      var cls = g.query_heads.indexOf(state.head) >= 0 ? "current" : "";
      return [String(g.kv_head), {text: g.query_heads.join(", "), cls: cls}, {text: dash(g.within), cls: cls}, {text: dash(g.across), cls: cls}];
    })));
    fillTable("key-norms", [["position"].concat(a.key_norms.map(function (n, s) { return String(s + 1); })),
      ["key token"].concat(a.key_norms.map(function (n, s) { return {text: token(s), cls: "tok"}; })),
      ["|k|"].concat(a.key_norms.map(function (n) { return {text: n.toFixed(2), cls: "num"}; }))]);
    var rope = a.rope_by_head[String(state.head)];
    el("rope-section").hidden = !rope;
    if (rope) {
      el("rope-note").textContent = "RoPE, head " + rope.head + ": the query of x(" + rope.query_position +
        ") and the key of x(" + rope.key_position + "), rotated as if they sat at other positions. The score " +
        "depends only on the distance between them (largest spread at equal distance: " +
        rope.largest_spread_at_equal_distance.toExponential(1) + "):";
      fillTable("rope-table", [["distance"].concat(rope.score_by_distance.map(function (p) { return String(p[0]); })),
        ["q \u00b7 k"].concat(rope.score_by_distance.map(function (p) { return {text: p[1].toFixed(4), cls: "num"}; }))]);
    }
  }
  el("layer-select").addEventListener("change", function (e) { state.layer = Number(e.target.value); fillControls(); render(); });
  el("head-select").addEventListener("change", function (e) { state.head = Number(e.target.value); render(); });
  fillControls();
  render();
}());
</script>
</body>
</html>
"""


def build_page(
    trace: Trace,
    *,
    title: str,
    subtitle: str,
    layer: int,
    head: int,
    query: int,
    analysis: dict[str, Any] | None = None,
    generation: list[CacheStep] | None = None,
    book: bool = False,
    images: dict[str, bytes] | None = None,
    generation_tokens: list[str] | None = None,
) -> str:
    """The page's HTML text. `layer`, `head`, `query` (from 0, among the new tokens) pick the
    story; `images` are the figures as PNG bytes, drawn here when not given;
    `generation_tokens` name the prompt and the generated tokens (default: the trace's).
    `analysis` (given for learned weights) turns on "What the learned weights do", which is
    then computed for every recorded layer so that the layer/head switch can show each."""
    tokens = trace.tokens or []
    focus_layer = trace.layer(layer)
    row = query_row(focus_layer, tokens, head, query)
    if images is None:
        images = render_pngs(layer_figures(focus_layer, tokens, head, query))
    figures = [{"caption": f"{_CAPTIONS[stem]} (layer {layer}"
                + ("" if stem in _LAYER_WIDE else f", head {head}") + ")", "uri": data_uri(data)}
               for stem, data in images.items()]
    layers = []
    for recorded in trace.layers:
        summary = layer_summary(recorded)
        summary["query_indices"] = recorded.queries
        summary["rows"] = _explorer_rows(recorded)
        layers.append(summary)
    if analysis is not None:  # learned weights: the switch shows each layer's analysis
        for summary, per_layer in zip(layers, trace_analyses(trace, head, query)):
            summary["analysis"] = per_layer
    data = {
        "tokens": tokens,
        "layers": layers,
        "focus": {"layer_slot": [l.index for l in trace.layers].index(layer), "layer": layer, "head": head,
                  "query": query, "query_position": row["query"]["position"]},
    }
    focus_keys = [
        {"number": s + 1, "token": token_at(tokens, s),
         "score": f"{row['scores'][s]:.4f}" if row["visible"][s] else (
             "(outside window)" if row["outside_window"][s] else "(masked)"),
         "scaled": "-inf" if row["scaled_scores"][s] is None else f"{row['scaled_scores'][s]:.4f}",
         "weight": f"{row['weights'][s]:.4f}"}
        for s in range(focus_layer.num_keys)
    ]
    steps_view = None
    if generation:
        named = generation_tokens or tokens
        steps_view = []
        for step in generation:
            weights = query_row(step.layer, named, head, 0)["weights"]
            top = max(weights) or 1.0
            steps_view.append({
                "token": token_at(named, step.position), "cached": step.cache_length,
                "weights": [{"token": token_at(named, s), "weight": w, "alpha": w / top}
                            for s, w in enumerate(weights)],
            })
    env = Environment(autoescape=True)
    return env.from_string(_TEMPLATE).render(
        title=title, subtitle=subtitle, tokens=tokens, focus=row,
        steps=story_steps(focus_layer, row, tokens, book=book, query=query), focus_keys=focus_keys, figures=figures,
        analysis=analysis,
        key_tokens=[token_at(tokens, s) for s in range(focus_layer.num_keys)],
        generation=steps_view, data_json=_safe_json(data), alike=ALIKE,
    )


_LAYER_WIDE = ("causal_mask", "heads")  # figures of the whole layer, not one head
_CAPTIONS = {
    "keys_plane": "The keys and the query as arrows in the plane, each key labelled with its dot product",
    "scores": "From scores to scaled scores to weights",
    "heatmap": "Every query's weights over the keys, the story's query marked",
    "causal_mask": "The causal mask (a local layer's: its sliding window too)",
    "heads": "Every recorded head of this layer",
}


def write_page(html: str, path: str | Path) -> Path:
    target = Path(path)
    if target.is_dir():
        raise QkvError(f"--html {target}: is a folder; give a file name such as attention.html")
    if not target.parent.is_dir():
        raise QkvError(f"--html {target}: the folder {target.parent} does not exist")
    write_atomic(target, html.encode("utf-8"))
    return target
