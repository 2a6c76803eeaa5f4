"""The explorer page served at `/`: one self-contained HTML file (vanilla JS, no request
leaves the server). Every text from the model or the user is set with textContent, never
parsed as HTML."""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>qkv serve: attention explorer</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;max-width:70em;color:#222}
textarea,input,select,button{font:inherit}
textarea{width:100%;box-sizing:border-box}
.tabs button{padding:.3em 1em}.tabs button.on{font-weight:bold}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ddd;padding:.15em .5em;text-align:right}
td.tok{text-align:left;font-family:monospace}.bar{background:#4a7bd0;height:.8em;display:inline-block}
#error,#chat-error{color:#b00020}.muted{color:#777}pre{white-space:pre-wrap;background:#f6f6f6;padding:.6em}
</style></head><body>
<h1>qkv: attention, live</h1>
<div class="tabs"><button id="tab-explore" class="on">Explore</button><button id="tab-chat">Chat</button>
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
<p id="error" role="alert"></p><p id="summary" class="muted"></p>
<table id="keys"><thead><tr><th>#</th><th>key token</th><th>score q·k</th><th>scaled</th><th>weight</th><th></th></tr></thead><tbody></tbody></table>
<p>context <span id="context" class="muted"></span></p>
<div id="generation"></div>
</section>
<section id="chat" hidden>
<p><textarea id="message" rows="3">Explain attention in one sentence.</textarea></p>
<p><button id="send">Send</button> max tokens <input id="max-tokens" type="number" value="64" style="width:5em"></p>
<p id="chat-error" role="alert"></p><pre id="reply"></pre>
</section>
<script>
"use strict";
const $ = id => document.getElementById(id);
const fmt = v => v === null ? "−∞" : Number(v).toFixed(4);
function headers() { const h = {"Content-Type": "application/json"}; const k = $("key").value;
  if (k) h["Authorization"] = "Bearer " + k; return h; }
function cell(row, text, cls) { const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; row.appendChild(td); return td; }
function options(select, labels, selected) { select.replaceChildren();
  labels.forEach(([value, label]) => { const o = document.createElement("option"); o.value = value;
    o.textContent = label; select.appendChild(o); }); if (selected !== undefined) select.value = String(selected); }
let last = null;
async function run(keepQuery) {
  $("error").textContent = "";
  const body = {text: $("text").value, layer: +$("layer").value, head: +$("head").value,
                query: keepQuery && $("query").value !== "" ? +$("query").value : null,
                generate: +$("generate").value || 0};
  try {
    const r = await fetch("/explorer/trace", {method: "POST", headers: headers(), body: JSON.stringify(body)});
    const data = await r.json();
    if (!r.ok) { $("error").textContent = data.error ? data.error.message : r.statusText; return; }
    last = data; show(data, body);
  } catch (e) { $("error").textContent = String(e); }
}
function show(d, body) {
  options($("layer"), [...Array(d.num_layers).keys()].map(i => [i, i]), d.layer);
  options($("head"), [...Array(d.num_heads).keys()].map(i => [i, i]), d.head);
  options($("query"), d.tokens.map((t, i) => [i, (i + 1) + ": " + t]), d.query.position - 1);
  $("summary").textContent = "layer " + d.layer + ", head " + d.head + " (kv head " + d.kv_head + "), query " +
    d.query.position + " \u201c" + d.query.token + "\u201d, scale " + fmt(d.scale);
  const tbody = $("keys").tBodies[0]; tbody.replaceChildren();
  d.key_tokens.forEach((t, i) => { const tr = document.createElement("tr"); tr.className = "key";
    cell(tr, i + 1); cell(tr, t, "tok"); cell(tr, fmt(d.scores[i])); cell(tr, fmt(d.scaled_scores[i]));
    cell(tr, fmt(d.weights[i]), "weight");
    const bar = document.createElement("span"); bar.className = "bar"; bar.style.width = (100 * (d.weights[i] || 0)) + "px";
    cell(tr, "").appendChild(bar); tbody.appendChild(tr); });
  $("context").textContent = "[" + d.context.map(fmt).join(", ") + "]";
  const g = $("generation"); g.replaceChildren();
  (d.generation || []).forEach(step => { const p = document.createElement("p");
    const top = step.weights.map((w, i) => [w, i]).sort((a, b) => b[0] - a[0]).slice(0, 3)
      .map(([w, i]) => step.key_tokens[i] + " " + fmt(w)).join(", ");
    p.textContent = "new token " + step.position + " \u201c" + step.token + "\u201d reads " + step.cached_keys +
      " cached keys; strongest: " + top; p.className = "step"; g.appendChild(p); });
}
$("run").onclick = () => run(true);
$("text").oninput = () => { $("query").value = ""; };
$("example").onchange = () => { if ($("example").value) { $("text").value = $("example").value; run(false); } };
["layer", "head", "query"].forEach(id => $(id).onchange = () => run(true));
$("tab-explore").onclick = () => { $("explore").hidden = false; $("chat").hidden = true; };
$("tab-chat").onclick = () => { $("explore").hidden = true; $("chat").hidden = false; };
$("send").onclick = async () => {
  $("chat-error").textContent = ""; $("reply").textContent = ""; delete $("reply").dataset.done;
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
