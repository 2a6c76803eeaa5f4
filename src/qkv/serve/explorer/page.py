"""The explorer page served at `/`: one self-contained HTML file (vanilla JS, no request
leaves the server). Every text from the model or the user is set with textContent, never
parsed as HTML.

What a learner sees: a legend for every column and symbol; the query's row marked; keys the
causal mask hides shown as masked, never with a score; the context as its length and first
values (all of them on request); the analysis the endpoint returns (weight on the first
token per head, key/value groups, key lengths by position, RoPE's score by distance); layers
and heads counted from 0, token positions from 1, as `qkv explain` counts them; the keys'
rows said to be clickable (a click splits that key's score: qkv.serve.explorer.why). An error
clears the previous results, so no stale numbers sit under it.
"""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>qkv serve: attention explorer</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;max-width:70em;color:#222}
textarea,input,select,button{font:inherit}
textarea{width:100%;box-sizing:border-box}
.tabs button{padding:.3em 1em;border:1px solid #99a;background:#f4f4f8;border-radius:.3em .3em 0 0}
.tabs button.on{font-weight:bold;background:#4a7bd0;color:#fff;border-color:#4a7bd0}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ddd;padding:.15em .5em;text-align:right}
td.tok{text-align:left;font-family:monospace}.bar{background:#4a7bd0;height:.8em;display:inline-block}
tr.key{cursor:pointer}tr.key:hover td{background:#eef3fb}tr.query td{background:#fde0ec;font-weight:bold}tr.masked td{color:#999}td.current,th.current{background:#fde0ec}
#error,#chat-error{color:#b00020}.muted{color:#777}pre{white-space:pre-wrap;background:#f6f6f6;padding:.6em}
#legend dt{font-weight:bold;float:left;clear:left;width:8em}#legend dd{margin-left:8.5em}
.you{background:#eef3fb;padding:.4em .6em;border-radius:.3em}.num{font-family:monospace}
</style></head><body>
<h1>qkv: attention, live</h1>
<div class="tabs" role="tablist"><button id="tab-explore" class="on" role="tab" aria-selected="true">Explore</button><button id="tab-chat" role="tab" aria-selected="false">Chat</button>
<label class="muted"> API key <input id="key" type="password" size="12"></label></div>
<section id="explore">
<p><textarea id="text" rows="3">The cat sat on the mat because it was tired</textarea></p>
<p><select id="example"><option value="">examples…</option>
<option>Your journey starts with one step</option>
<option>The animal didn't cross the street because it was too tired</option>
<option>Alice gave Bob the book, and he thanked her</option></select>
layer <select id="layer"><option>0</option></select>
head <select id="head"><option>0</option></select>
query <select id="query"><option value="">last</option></select>
generate <input id="generate" type="number" min="0" max="16" value="0" style="width:4em">
<button id="run">Trace</button></p>
<details id="legend" open><summary>What the columns and symbols mean</summary><dl>
<dt>#</dt><dd>the key's position, counted from 1 (as the book writes x(2)); layers and heads count from 0, as transformers counts them</dd>
<dt>score q·k</dt><dd>the dot product of the query with this key: how well they match</dd>
<dt>scaled</dt><dd>the score times the scale 1/sqrt(d_k), so softmax does not saturate</dd>
<dt>weight</dt><dd>softmax of the scaled scores: this key's share of the attention (they sum to 1); the bar draws it</dd>
<dt>masked</dt><dd>a key after the query, hidden by the causal mask: never scored, its scaled score is −∞ and its weight 0</dd>
<dt>query row</dt><dd>the highlighted row is the query token itself (it sees its own key)</dd>
<dt>context</dt><dd>weights @ values: the query's new vector, shown as its length |c| and first values (open it for all)</dd>
<dt>click a row</dt><dd>each key's row is clickable: it shows why the query looks at that key, its score split exactly into what wrote the query and the key (the largest terms appear under the table)</dd>
<dt>␣ ↵ →</dt><dd>a leading space, a newline and a tab inside a token</dd>
</dl></details>
<p id="error" role="alert"></p><p id="summary" class="muted"></p>
<div id="results">
<p class="muted" id="click-hint">Click a key's row to see why the query looks at it.</p>
<table id="keys"><thead><tr><th>#</th><th>key token</th><th>score q·k</th><th>scaled</th><th>weight</th><th></th></tr></thead><tbody></tbody></table>
<p>context <span id="context" class="num"></span></p>
<details id="context-all"><summary>all values</summary><pre id="context-values"></pre></details>
<div id="analysis"></div>
<div id="generation"></div>
</div>
</section>
<section id="chat" hidden>
<p><textarea id="message" rows="3">Explain attention in one sentence.</textarea></p>
<p><button id="send">Send</button> max tokens <input id="max-tokens" type="number" value="64" style="width:5em"></p>
<p id="chat-error" role="alert"></p>
<div id="transcript"><p id="you" class="you" hidden></p><pre id="reply"></pre></div>
</section>
<script>
"use strict";
const $ = id => document.getElementById(id);
const fmt = v => v === null ? "−∞" : Number(v).toFixed(4);
const SHOWN = 4;  // context values shown before "…"
function headers() { const h = {"Content-Type": "application/json"}; const k = $("key").value;
  if (k) h["Authorization"] = "Bearer " + k; return h; }
function el(tag, text, cls) { const e = document.createElement(tag); if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls; return e; }
function cell(row, text, cls) { const td = el("td", text, cls); row.appendChild(td); return td; }
function options(select, labels, selected) { select.replaceChildren();
  labels.forEach(([value, label]) => { const o = document.createElement("option"); o.value = value;
    o.textContent = label; select.appendChild(o); }); if (selected !== undefined) select.value = String(selected); }
function table(rows, id) { const t = el("table"); if (id) t.id = id;
  rows.forEach((cells, r) => { const tr = el("tr");
    cells.forEach((c, i) => { const td = el(r === 0 || i === 0 ? "th" : "td", typeof c === "object" ? c.text : c);
      if (typeof c === "object" && c.cls) td.className = c.cls; tr.appendChild(td); });
    t.appendChild(tr); }); return t; }
function clearResults() {
  $("summary").textContent = ""; $("keys").tBodies[0].replaceChildren(); $("context").textContent = "";
  $("context-values").textContent = ""; $("analysis").replaceChildren(); $("generation").replaceChildren();
  $("results").hidden = true;
}
function fail(message) { clearResults(); $("error").textContent = message; }
let last = null;
async function run(keepQuery) {
  $("error").textContent = "";
  const body = {text: $("text").value, layer: +$("layer").value, head: +$("head").value,
                query: keepQuery && $("query").value !== "" ? +$("query").value : null,
                generate: +$("generate").value || 0};
  try {
    const r = await fetch("/explorer/trace", {method: "POST", headers: headers(), body: JSON.stringify(body)});
    const data = await r.json();
    if (!r.ok) { fail(data.error ? data.error.message : r.statusText); return; }
    last = data; show(data);
  } catch (e) { fail(String(e)); }
}
function showContext(values) {
  const norm = Math.sqrt(values.reduce((s, v) => s + v * v, 0));
  $("context").textContent = "|c| = " + norm.toFixed(4) + ", [" + values.slice(0, SHOWN).map(fmt).join(", ") +
    (values.length > SHOWN ? ", …" : "") + "] (" + values.length + " values)";
  $("context-values").textContent = "[" + values.map(fmt).join(", ") + "]";
}
function showAnalysis(d) {
  const a = d.analysis, box = $("analysis"); box.replaceChildren();
  if (!a) return;
  box.appendChild(el("h3", "What this layer's learned weights do"));
  const heads = Object.keys(a.sink_share);
  box.appendChild(el("p", "Weight on the first token \u201c" + d.tokens[0] + "\u201d, per head, for " +
    (a.sink_queries === 1 ? "this query" : a.sink_queries + " queries") +
    " (an attention sink parks weight there); this head is marked:"));
  const mark = h => (+h === d.head ? "current" : "");
  box.appendChild(table([["head", ...heads.map(h => ({text: h, cls: mark(h)}))],
    ["weight on token 1", ...heads.map(h => ({text: a.sink_share[h].toFixed(3), cls: mark(h)}))]], "sink"));
  const info = d.layer_info;
  if (info.num_kv_heads !== info.num_heads) {
    box.appendChild(el("p", "Grouped-query attention: " + info.num_heads + " query heads share " + info.num_kv_heads +
      " key/value heads; this head reads key/value head " + d.kv_head + ". Alike: how similarly two heads spread " +
      "their weights (1 - total variation distance), within a group and across groups."));
    const dash = v => v === null ? "-" : v.toFixed(3);
    box.appendChild(table([["kv head", "query heads", "alike within", "alike across"],
      ...a.kv_groups.map(g => { const cls = g.kv_head === d.kv_head ? "current" : "";
        return [String(g.kv_head), {text: g.query_heads.join(", "), cls}, {text: dash(g.within_group_similarity), cls},
                {text: dash(g.across_group_similarity), cls}]; })], "kv-groups"));
  }
  box.appendChild(el("p", "Key length |k| by position (counted from 1; mean over the key/value heads):"));
  box.appendChild(table([["position", ...a.key_norms.map((n, s) => String(s + 1))],
    ["key token", ...a.key_norms.map((n, s) => ({text: d.key_tokens[s], cls: "tok"}))],
    ["|k|", ...a.key_norms.map(n => n.toFixed(2))]], "key-norms"));
  if (a.rope) {
    const r = a.rope, dist = Object.keys(r.score_by_distance);
    box.appendChild(el("p", "RoPE: the query of x(" + r.query_position + ") and the key of x(" + r.key_position +
      "), rotated as if they sat at " + r.pairs.length + " other pairs of positions. The score depends only on the " +
      "distance between them (largest spread at equal distance: " + r.largest_spread_at_equal_distance.toExponential(1) + "):"));
    box.appendChild(table([["distance", ...dist], ["q·k", ...dist.map(k => r.score_by_distance[k].toFixed(4))]], "rope"));
  }
}
function show(d) {
  $("results").hidden = false;
  options($("layer"), [...Array(d.num_layers).keys()].map(i => [i, i]), d.layer);
  options($("head"), [...Array(d.num_heads).keys()].map(i => [i, i]), d.head);
  options($("query"), d.tokens.map((t, i) => [i + 1, (i + 1) + ": " + t]), d.query.position);
  $("summary").textContent = "layer " + d.layer + ", head " + d.head + " (kv head " + d.kv_head + "), query x(" +
    d.query.position + ") \u201c" + d.query.token + "\u201d, scale 1/sqrt(" + d.layer_info.head_dim + ") = " + fmt(d.scale);
  const tbody = $("keys").tBodies[0]; tbody.replaceChildren();
  d.key_tokens.forEach((t, i) => { const visible = d.visible[i];
    const tr = el("tr", undefined, "key" + (visible ? "" : " masked") + (i === d.query.position - 1 ? " query" : ""));
    tr.dataset.key = String(i + 1);
    cell(tr, i + 1); cell(tr, t, "tok"); cell(tr, visible ? fmt(d.scores[i]) : "masked", "score");
    cell(tr, visible ? fmt(d.scaled_scores[i]) : "masked", "scaled"); cell(tr, fmt(d.weights[i]), "weight");
    const bar = el("span", undefined, "bar"); bar.style.width = (100 * (d.weights[i] || 0)) + "px";
    cell(tr, "").appendChild(bar); tbody.appendChild(tr); });
  showContext(d.context);
  showAnalysis(d);
  const g = $("generation"); g.replaceChildren();
  (d.generation || []).forEach(step => {
    const top = step.weights.map((w, i) => [w, i]).sort((a, b) => b[0] - a[0]).slice(0, 3)
      .map(([w, i]) => (i + 1) + " " + step.key_tokens[i] + " " + fmt(w)).join(", ");
    g.appendChild(el("p", "new token x(" + step.position + ") \u201c" + step.token + "\u201d reads " + step.cached_keys +
      " cached keys; strongest: " + top, "step")); });
}
function tab(name) {
  ["explore", "chat"].forEach(n => { const on = n === name; $(n).hidden = !on;
    $("tab-" + n).classList.toggle("on", on); $("tab-" + n).setAttribute("aria-selected", String(on)); });
}
$("run").onclick = () => run(true);
$("text").oninput = () => { $("query").value = ""; };
$("example").onchange = () => { if ($("example").value) { $("text").value = $("example").value; run(false); } };
["layer", "head", "query"].forEach(id => $(id).onchange = () => run(true));
$("tab-explore").onclick = () => tab("explore");
$("tab-chat").onclick = () => tab("chat");
$("send").onclick = async () => {
  $("chat-error").textContent = ""; $("reply").textContent = ""; delete $("reply").dataset.done;
  $("you").textContent = "You: " + $("message").value; $("you").hidden = false;
  const models = await (await fetch("/v1/models", {headers: headers()})).json();
  if (!models.data) { $("chat-error").textContent = models.error ? models.error.message : "no model"; return; }
  const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify({
    model: models.data[0].id, stream: true, temperature: 0, max_tokens: +$("max-tokens").value,
    messages: [{role: "user", content: $("message").value}]})});
  if (!r.ok) { const e = await r.json(); $("chat-error").textContent = e.error ? e.error.message : r.statusText; return; }
  const reader = r.body.getReader(); const decoder = new TextDecoder(); let buffer = "";
  for (;;) { const {done, value} = await reader.read(); if (done) break;
    buffer += decoder.decode(value, {stream: true}); let at;
    while ((at = buffer.indexOf("\n\n")) >= 0) { const line = buffer.slice(0, at); buffer = buffer.slice(at + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) { $("chat-error").textContent = chunk.error.message; continue; }
      const c = chunk.choices[0]; if (c && c.delta && c.delta.content) $("reply").textContent += c.delta.content; } }
  $("reply").dataset.done = "1";
};
run(false);
</script></body></html>
"""
