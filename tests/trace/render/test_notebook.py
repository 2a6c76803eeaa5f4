"""Trace._repr_html_: the recorded weights as an escaped HTML table, masked keys blank."""

from __future__ import annotations

import re

from qkv.trace.record.book_example import book_trace
from qkv.trace.render.notebook import trace_html


def test_weights_table_holds_the_recorded_weights():
    trace = book_trace(causal=True)
    page = trace_html(trace, figures=False)
    weights = trace.layers[0].weights[0, 0]  # (T, T)
    shown = [float(v) for v in re.findall(r'title="weight ([0-9.]+)"', page)]
    visible = weights[trace.layers[0].mask[0, 0]]
    assert shown == [round(float(w), 4) for w in visible]
    assert page.count('title="masked"') == 15  # above the diagonal of 6 x 6
    assert "data:image/png" not in page


def test_repr_html_draws_figures_and_escapes_tokens():
    trace = book_trace()
    trace.tokens = ["<b>", *trace.tokens[1:]]
    page = trace._repr_html_()
    assert "&lt;b&gt;" in page and "<b>" not in page
    assert page.count("data:image/png;base64,") == 2


def test_the_figures_say_which_query_their_score_bars_show():
    trace = book_trace()
    assert "score bars: query x(6) “step”" in trace._repr_html_()  # the last query by default
    assert "score bars: query x(2) “journey”" in trace_html(trace, query=1)  # the book's query
