"""The page `qkv explain --why --html FILE` writes: the attribution's section
(qkv.trace.render.attribution_view) and its figures inline, one self-contained file, every
string escaped, nothing fetched."""

from __future__ import annotations

import html

from qkv.trace.explain.attribution import ScoreAttribution
from qkv.trace.render.attribution_view import attribution_html, row_lines
from qkv.trace.render.html import data_uri

_CAPTIONS = {
    "why_pairs": "The largest (query source × key source) terms of each key's score, stacked; the "
    "black tick is the score, which the stack sums to",
    "why_rope_pairs": "Each RoPE pair's term of the score, rotated (as scored) and unrotated (content "
    "alone), against the pair's wavelength",
}


def why_page(result: ScoreAttribution, key: int, model: str, images: dict[str, bytes]) -> str:
    title = f"Why this key? {model}, layer {result.layer}, head {result.head}"
    figures = "".join(
        f'<figure><img alt="{html.escape(stem)}" src="{data_uri(data)}">'
        f"<figcaption>{html.escape(_CAPTIONS.get(stem, stem))}</figcaption></figure>"
        for stem, data in images.items())
    row = html.escape("\n".join(row_lines(result)))
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>body{{font-family:system-ui,sans-serif;margin:2em;"
        "max-width:80em}img{max-width:100%}figure{margin:1em 0}pre{background:#f6f6f6;padding:.5em}"
        "</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{attribution_html(result, key)}{figures}"
        f"<h3>Every key of this query</h3><pre>{row}</pre></body></html>")
