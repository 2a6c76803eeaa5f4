"""Showing why a query picks a key: terminal lines (80 columns), an HTML section, and the
lines for patches and sweeps.

Every line here fits 80 columns: token texts are cut to a fixed width, numbers have fixed
formats. The HTML section escapes every string and is what `ScoreAttribution._repr_html_`
shows in Jupyter and what `qkv explain --why --html` puts on its page.

`qkv explain` prints the words' legend under these lines (qkv.trace.render.attribution_legend);
the HTML section carries it inside.

Shape legend: S attributed keys, nq / nk query / key sources, D/2 RoPE pairs.
"""

from __future__ import annotations

import html
from collections.abc import Callable

from qkv.trace.explain.attribution import ScoreAttribution
from qkv.trace.explain.patching import PatchOutcome, PatchSweep
from qkv.trace.explain.sink import SinkAttribution
from qkv.trace.record.views import register_html_view
from qkv.trace.render.attribution_legend import legend_html, why_sentences

WIDTH = 80
TOKEN = 12  # characters of a token's text shown in a row


def short(text: str, width: int = TOKEN) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _named(result: ScoreAttribution, position: int) -> str:
    if result.tokens is None:
        return str(position + 1)
    return f'{position + 1} "{short(result.token(position))}"'


def _html_named(result: ScoreAttribution, position: int) -> str:
    if result.tokens is None:
        return str(position + 1)
    return f"{position + 1} “{html.escape(result.token(position))}”"


def term_lines(result: ScoreAttribution, key: int, top: int = 12) -> list[str]:
    """The split of one score: a header, one row per term (largest first), the rest summed,
    the RoPE pairs, and the query heads that share the key."""
    s = result.slot(key)
    score = float(result.scores[s])
    total = float(result.pairs[s].sum())
    lines = [
        f"Why does query {_named(result, result.query)} look at key {_named(result, key)}?",
        f"layer {result.layer}, head {result.head} (kv head {result.kv_head}); "
        f"score q·k {score:.4f}, scaled {score * result.scale:.4f}, weight {float(result.weights[s]):.4f}",
        f"sum of the {result.pairs[s].numel()} terms {total:.4f} (exact: checked against the model)",
        "",
        f"{'query source':<16}{'key source':<16}{'term':>11}{'scaled':>11}{'share':>9}",
    ]
    shown = 0.0
    for q_source, k_source, term in result.top_pairs(key, top):
        shown += term
        share = f"{term / score:>8.1%}" if abs(score) > 1e-12 else f"{'-':>8}"
        lines.append(f"{short(q_source, 15):<16}{short(k_source, 15):<16}{term:>11.4f}"
                     f"{term * result.scale:>11.4f} {share}")
    rest = total - shown
    count = result.pairs[s].numel() - min(top, result.pairs[s].numel())
    lines.append(f"{f'the other {count} terms':<32}{rest:>11.4f}{rest * result.scale:>11.4f}")
    lines += [""] + _side_lines("key sources (summed over query sources)", result.key_sources,
                                result.key_totals(key).tolist())
    lines += _side_lines("query sources (summed over key sources)", result.query_sources,
                         result.query_totals(key).tolist())
    if result.bands is not None:
        lines += ["", "RoPE pairs, largest first: the pair's share rotated, and unrotated (content)",
                  f"{'pair':>5}{'wavelength':>12}{'angle (rad)':>13}{'rotated':>12}{'unrotated':>12}"]
        order = result.bands[s].abs().argsort(descending=True)[:8]
        for f in order.tolist():
            lines.append(f"{f:>5}{float(result.wavelengths[f]):>12.1f}{float(result.angles[s, f]):>13.3f}"
                         f"{float(result.bands[s, f]):>12.4f}{float(result.bands_unrotated[s, f]):>12.4f}")
        lines.append(f"{'all pairs':>30}{float(result.bands[s].sum()):>12.4f}"
                     f"{float(result.bands_unrotated[s].sum()):>12.4f}")
    lines += ["", f"query heads sharing kv head {result.kv_head}: score of this key, weight"]
    for g, head in enumerate(result.group_heads):
        mark = "  <- this head" if head == result.head else ""
        lines.append(f"  head {head:>3}: {float(result.group_scores[g, s]):>11.4f}"
                     f"{float(result.group_weights[g, s]):>9.4f}{mark}")
    return lines


def _side_lines(title: str, names: list[str], totals: list[float], count: int = 5) -> list[str]:
    order = sorted(range(len(names)), key=lambda i: -abs(totals[i]))[:count]
    cells = [f"{short(names[i], 10)} {totals[i]:.3f}" for i in order]
    lines, line = [f"{title}:"], " "
    for cell in cells:
        if len(line) + len(cell) + 3 > WIDTH:
            lines.append(line)
            line = " "
        line += f" {cell};"
    return lines + [line.rstrip(";")]


def row_lines(result: ScoreAttribution) -> list[str]:
    """One row per key of the query row: score, weight and its largest term."""
    lines = [f"Every key of query {_named(result, result.query)}: layer {result.layer}, head {result.head}",
             f"{'key':<18}{'score':>9}{'weight':>8}  {'largest term (query x key source)':<43}"]
    for key in result.keys:
        s = result.slot(key)
        q_source, k_source, term = result.top_pairs(key, 1)[0]
        pair = short(f"{q_source} x {k_source}", 30)
        lines.append(f"{short(_named(result, key), 17):<18}{float(result.scores[s]):>9.3f}"
                     f"{float(result.weights[s]):>8.4f}  {pair:<31}{term:>11.3f}")
    return lines


def sink_lines(sinks: list[SinkAttribution]) -> list[str]:
    lines = ["The sink explained: the heads that put the most weight on the first token",
             "(sink: that weight, averaged over the queries after it), and the first key's",
             "mean score split into (query source x key source) terms",
             f"{'layer':>5}{'head':>5}{'sink':>7}{'score':>9}{'share':>7}  {'key sources carrying it':<45}"]
    for sink in sinks:
        carried = ", ".join(f"{short(n, 9)} {v:.1f}" for n, v in sink.key_totals()[:3])
        lines.append(f"{sink.layer:>5}{sink.head:>5}{sink.sink_mass:>7.3f}{sink.score:>9.2f}"
                     f"{sink.top_share(3):>7.0%}  {short(carried, 45)}")
    for sink in sinks[:1]:
        lines.append(f"largest terms of layer {sink.layer} head {sink.head}:")
        for q, k, t in sink.top_pairs(3):
            lines.append(f"  {short(q, 15):<16}x {short(k, 15):<16}{t:>11.3f}")
    return lines


def patch_lines(outcome: PatchOutcome, what: str, key: int, decode: Callable[[int], str],
                tokens: list[str]) -> list[str]:
    before, after = float(outcome.weights_before[key]), float(outcome.weights_after[key])

    def top(pairs: list[tuple[int, float]]) -> str:
        return ", ".join(f'"{short(decode(i), 10)}" {p:.3f}' for i, p in pairs[:3])

    return [short(f"Patch: {what}", WIDTH),
            f"  this head's weight on key {key + 1} \"{short(tokens[key])}\": {before:.4f} -> {after:.4f}",
            f"  the layer's output at the query moved by {outcome.layer_change:.1%} of its length",
            f"  next token: KL(before || after) = {outcome.kl:.4f} nats",
            short(f"  before: {top(outcome.top_before)}", WIDTH),
            short(f"  after:  {top(outcome.top_after)}", WIDTH)]


def sweep_lines(sweep: PatchSweep, tokens: list[str], decode: Callable[[int], str], count: int = 3) -> list[str]:
    donor = "the other prompt's" if sweep.donor == "prompt" else "the mean"
    lines = [short(f"Patch sweep: each {sweep.kind} in turn replaced by {donor} at that position;", WIDTH),
             short(f"prediction \"{decode(sweep.top_token)}\" ({sweep.top_probability:.3f}); per layer the"
                   f" {count} positions", WIDTH),
             "whose patch moves it most (KL in nats, fall in its probability):",
             f"{'layer':>5}  positions"]
    for row in sweep.rows:
        order = sorted(range(len(row.kl)), key=lambda p: -row.kl[p])[:count]
        cells = [f'{p + 1} "{short(tokens[p], 8)}" {row.kl[p]:.3f}/{row.target_drop[p]:+.2f}' for p in order]
        lines.append(short(f"{row.layer:>5}  " + "  ".join(cells), WIDTH))
    best = ", ".join(f'L{l} {p + 1} "{short(tokens[p], 10)}"' for l, p, _ in sweep.strongest(3))
    lines.append(short(f"strongest overall: {best}", WIDTH))
    return lines


def attribution_html(result: ScoreAttribution, key: int | None = None, top: int = 12) -> str:
    """An HTML section: the top terms, the layer-level matrix, the RoPE pairs, the group."""
    key = result.keys[-1] if key is None else key
    s = result.slot(key)
    e = html.escape
    score = float(result.scores[s])
    rows = "".join(
        f"<tr><td>{e(q)}</td><td>{e(k)}</td><td>{t:.4f}</td><td>{t * result.scale:.4f}</td>"
        f"<td>{(t / score if abs(score) > 1e-12 else 0):.1%}</td></tr>"
        for q, k, t in result.top_pairs(key, top))
    q_names, k_names, coarse = result.coarse(key)
    q_keep = sorted(range(len(q_names)), key=lambda i: -float(coarse[i].abs().sum()))[:8]
    k_keep = sorted(range(len(k_names)), key=lambda j: -float(coarse[:, j].abs().sum()))[:8]
    matrix = "<tr><th>query \\ key</th>" + "".join(f"<th>{e(k_names[j])}</th>" for j in k_keep) + "</tr>"
    matrix += "".join("<tr><th>" + e(q_names[i]) + "</th>" + "".join(
        f"<td>{float(coarse[i, j]):.3f}</td>" for j in k_keep) + "</tr>" for i in q_keep)
    bands = ""
    if result.bands is not None:
        order = result.bands[s].abs().argsort(descending=True)[:8].tolist()
        bands = ("<h4>RoPE pairs (largest first)</h4><table><tr><th>pair</th><th>wavelength</th><th>angle</th>"
                 "<th>rotated</th><th>unrotated</th></tr>" + "".join(
                     f"<tr><td>{f}</td><td>{float(result.wavelengths[f]):.1f}</td><td>{float(result.angles[s, f]):.3f}"
                     f"</td><td>{float(result.bands[s, f]):.4f}</td><td>{float(result.bands_unrotated[s, f]):.4f}</td></tr>"
                     for f in order) + "</table>")
    group = ", ".join(f"head {h}: {float(result.group_scores[g, s]):.3f} (weight {float(result.group_weights[g, s]):.3f})"
                      for g, h in enumerate(result.group_heads))
    return (
        '<section class="qkv-why"><style>.qkv-why table{border-collapse:collapse;margin:.5em 0}'
        ".qkv-why td,.qkv-why th{border:1px solid #ccc;padding:.15em .45em;text-align:right}</style>"
        f"<h3>Why query {_html_named(result, result.query)} looks at key {_html_named(result, key)}</h3><p>Layer {result.layer}, head {result.head} (kv head {result.kv_head}): "
        f"score q·k = {score:.4f}, scaled {score * result.scale:.4f}, weight {float(result.weights[s]):.4f}. "
        f"The {result.pairs[s].numel()} terms sum to {float(result.pairs[s].sum()):.4f}, checked against the "
        "model's score.</p><h4>Largest terms (query source × key source)</h4><table><tr><th>query source</th>"
        f"<th>key source</th><th>term</th><th>scaled</th><th>share</th></tr>{rows}</table>"
        f"<h4>By layer (heads summed)</h4><table>{matrix}</table>{bands}"
        f"<p>Query heads sharing kv head {result.kv_head}: {e(group)}.</p>"
        f"{legend_html(why_sentences(result, key, page=True))}</section>"
    )


register_html_view(ScoreAttribution, attribution_html)
