"""The page in Chromium: each projection's real shape (grouped-query attention), the layer and
head switch reaching "What the learned weights do", every section saying which layer it shows,
the context's wording following the mask, and one step numbering with the terminal."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import qkv
from qkv.trace import trace
from qkv.trace.explain.analysis import key_norms, sink_share
from qkv.trace.record.book_example import book_trace
from qkv.trace.render.html import build_page, write_page
from qkv.book.steps import STEPS

from .test_html_browser import _open, browser  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def llama_page(tiny_decoder, tmp_path_factory):
    """A tiny Llama with 4 query heads sharing 2 key/value heads, traced on every layer."""
    folder, reference = tiny_decoder("llama")
    model, _ = qkv.load_pretrained(str(folder))
    tokens = [f"t{i}" for i in range(8)]
    recorded = trace(model.eval(), torch.tensor([[5, 9, 3, 17, 40, 2, 8, 11]]), tokens=tokens)
    from qkv.trace.explain.analysis import analyse

    html = build_page(recorded, title="llama", subtitle="s", layer=0, head=0, query=7,
                      analysis=analyse(recorded.layer(0), 0, 7))
    return write_page(html, tmp_path_factory.mktemp("page") / "llama.html"), recorded, reference


def test_projections_show_their_own_shapes_under_grouped_query_attention(browser, llama_page):
    target, _, reference = llama_page
    page, requests, errors = _open(browser, target)
    attention = reference.model.layers[0].self_attn  # transformers' own (out, in) weights
    shapes = {name: tuple(getattr(attention, proj).weight.shape[::-1])
              for name, proj in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"))}
    assert shapes["W_key"] != shapes["W_query"]  # the test model really is grouped
    shown = page.inner_text("#step-2 .num")
    assert shown == ", ".join(f"{name} [{a}, {b}]" for name, (a, b) in shapes.items())
    assert "each" not in shown
    assert requests == [target.as_uri()] and errors == []
    page.close()


def _sink_cells(page) -> list[str]:
    return page.locator("#sink-table tr:nth-child(2) td").all_inner_texts()


def test_the_switch_updates_the_analysis_and_every_section_names_its_layer(browser, llama_page):
    target, recorded, _ = llama_page
    page, requests, errors = _open(browser, target)

    def expected_sinks(layer: int) -> list[str]:
        return [f"{v:.3f}" for v in sink_share(recorded.layer(layer)).values()]

    assert _sink_cells(page) == expected_sinks(0)
    assert "show this layer and head" in page.inner_text("#scope-note")
    captions = page.locator("h2").all_inner_texts()
    assert any(c.startswith("The story") and "layer 0, head 0" in c for c in captions)
    figures = [c for c in captions if c.startswith(("From scores", "Every query", "The causal", "Every recorded"))]
    assert figures and all("(layer 0" in c for c in figures)

    page.select_option("#layer-select", "1")
    page.select_option("#head-select", "3")
    assert _sink_cells(page) == expected_sinks(1) != expected_sinks(0)
    assert page.inner_text("#analysis-scope") == "layer 1; head 3 marked"
    assert page.locator("#sink-table td.current").all_inner_texts() == ["3", expected_sinks(1)[3]]
    note = page.inner_text("#scope-note")
    assert "stay at layer 0, head 0" in note and "--layer 1 --head 3" in note
    norms = page.locator("#key-norms tr").all_inner_texts()
    assert norms[0].split() == ["position"] + [str(s + 1) for s in range(8)]  # counted from 1
    assert norms[2].split()[1:] == [f"{n:.2f}" for n in key_norms(recorded.layer(1))]
    # Head 3 reads key/value head 1: its group is the one marked.
    assert page.locator("#kv-groups td.current").first.inner_text() == "2, 3"
    assert "head 3" in page.inner_text("#rope-note")
    assert requests == [target.as_uri()] and errors == []
    page.close()


def _page_headings(browser, tmp_path, causal: bool, query: int) -> tuple[list[str], str]:
    target = write_page(build_page(book_trace(causal=causal), title="book", subtitle="s", layer=0, head=0,
                                   query=query - 1, book=True), tmp_path / f"book-{causal}-{query}.html")
    page, _, errors = _open(browser, target)
    headings = page.locator(".step > b").all_inner_texts()
    context = page.inner_text("#step-9")
    assert errors == []
    page.close()
    return headings, context


def _terminal(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "qkv", "explain", *args], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return out.splitlines()


def test_terminal_and_page_number_the_steps_alike_and_word_the_context_by_the_mask(browser, tmp_path):
    lines = _terminal("--causal", "--query", "2")
    terminal = [line.split("  ")[0] for line in lines if re.match(r"\d+\. ", line)]
    page, context = _page_headings(browser, tmp_path, causal=True, query=2)
    assert len(terminal) == len(page) == 9  # the book's single head: no output projection
    for number, ((_, name), shown_here, shown_there) in enumerate(zip(STEPS, terminal, page), start=1):
        assert shown_here.startswith(f"{number}. {name}") and shown_there.startswith(f"{number}. {name}")
    # With the mask, x(2) sees only two tokens, not the whole sentence; in both places.
    assert "whole sentence" not in context and "the mask hides the later ones" in context
    assert "whole sentence" not in " ".join(lines) and "the mask hides" in " ".join(lines)
    _, open_context = _page_headings(browser, tmp_path, causal=False, query=2)
    assert "whole sentence" in open_context
    assert any("whole sentence" in line for line in _terminal("--query", "2"))
