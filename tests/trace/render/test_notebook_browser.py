"""The notebook's weights table in Chromium on a bare page (no Jupyter stylesheet, as on
GitHub or in an nbconvert export): neighbouring numbers keep a visible gap."""

from __future__ import annotations

import pytest

from qkv.trace.record.book_example import book_trace
from qkv.trace.render.notebook import trace_html

from .test_html_browser import _open, browser  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.browser

GAP = 6  # px between the text of two neighbouring cells, at the least

# For every row: the left and right edge of each cell's text (not the cell's box).
TEXT_EDGES = """table => [...table.rows].map(row => [...row.cells].filter(c => c.textContent).map(c => {
  const range = document.createRange(); range.selectNodeContents(c);
  const box = range.getBoundingClientRect(); return [box.left, box.right];
}))"""


def test_weights_table_numbers_do_not_run_together_without_a_stylesheet(browser, tmp_path):  # noqa: F811
    target = tmp_path / "bare.html"
    target.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>"
                      f"{trace_html(book_trace(), figures=False)}</body></html>", encoding="utf-8")
    page, requests, errors = _open(browser, target)
    rows = page.eval_on_selector("table", TEXT_EDGES)
    assert len(rows) == 7 and all(len(row) == 7 for row in rows[1:])  # the keys' row, then 6 queries
    gaps = [right[0] - left[1] for row in rows for left, right in zip(row, row[1:])]
    assert min(gaps) >= GAP, gaps
    assert requests == [target.as_uri()] and errors == []
    page.close()
