"""The HTML page in a real browser: Debian's Chromium, headless, driven by Playwright.

The page must show the traced tokens and numbers, its controls must change them, user text
must stay inert, and no request may leave the page. Without Chromium these tests are
skipped with a plain reason, except in CI (env var CI set), where they fail instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.trace import trace
from qkv.trace.record.book_example import book_trace
from qkv.trace.render.html import build_page, write_page
from qkv.book.walkthrough import BOOK_TOKENS, run_walkthrough

pytestmark = pytest.mark.browser

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"]


def _chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        reason = "Chromium not found (Debian package `chromium`; `make install-dev` installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: browser tests must run in CI")
        pytest.skip(f"{reason}: browser tests skipped")
    return found


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


def _open(browser, path: Path):
    """The page, with every request it makes recorded (and only local files let through)."""
    page = browser.new_page()
    requests: list[str] = []
    errors: list[str] = []

    def handle(route):
        requests.append(route.request.url)
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            route.abort()

    page.route("**/*", handle)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    return page, requests, errors


def _weights_column(page) -> list[str]:
    return page.locator("#explorer tbody tr td:nth-child(5)").all_inner_texts()


def test_book_page_shows_the_numbers_and_the_query_picker_changes_them(browser, tmp_path):
    recorded = book_trace(causal=True)
    target = write_page(build_page(recorded, title="book", subtitle="s", layer=0, head=0, query=1, book=True),
                        tmp_path / "book.html")
    page, requests, errors = _open(browser, target)
    assert page.locator("#story-tokens span").all_inner_texts() == list(BOOK_TOKENS)
    journey = run_walkthrough(query_position=2, causal=True)
    assert _weights_column(page) == [f"{w:.4f}" for w in journey.weights.tolist()]
    assert page.inner_text("#context-out") == "[" + ", ".join(f"{v:.4f}" for v in journey.context.tolist()) + "]"
    # The book prints this context for "journey" without the mask; with it, the page follows the trace.
    page.click("#query-buttons button[data-query='4']")  # x(5), "one"
    one = run_walkthrough(query_position=5, causal=True)
    assert _weights_column(page) == [f"{w:.4f}" for w in one.weights.tolist()]
    assert page.locator("#query-buttons button.active").inner_text() == "5 one"
    assert page.locator("#explorer tbody tr.query td:nth-child(2)").all_inner_texts() == ["one"]  # its own row
    page.hover("#explorer tbody tr[data-key='1']")
    detail = page.inner_text("#detail")
    assert "journey" in detail and f"weight = {one.weights[1]:.4f}" in detail
    assert f"q · k = {one.scores[1]:.4f}" in detail
    assert requests == [target.as_uri()] and errors == []
    page.close()


def test_head_and_layer_controls_switch_among_recorded(browser, tmp_path):
    torch.manual_seed(2)
    model = GPT2Decoder(GPTConfig(vocab_size=40, context_length=16, emb_dim=16, n_heads=4, n_layers=2)).eval()
    tokens = ["The", "cat", "sat", "on", "the", "mat"]
    recorded = trace(model, torch.tensor([[3, 4, 5, 6, 3, 7]]), tokens=tokens)
    target = write_page(build_page(recorded, title="gpt", subtitle="s", layer=0, head=0, query=5),
                        tmp_path / "gpt.html")
    page, requests, errors = _open(browser, target)

    def expected(layer: int, head: int, query: int) -> list[str]:
        return [f"{w:.4f}" for w in recorded.layer(layer).weights[0, head, query].tolist()]

    assert _weights_column(page) == expected(0, 0, 5)
    page.select_option("#head-select", "3")
    assert _weights_column(page) == expected(0, 3, 5)
    page.select_option("#layer-select", "1")
    assert _weights_column(page) == expected(1, 3, 5)
    assert page.locator("#head-select option").all_inner_texts() == [f"head {h}" for h in range(4)]
    page.click("#query-buttons button[data-query='2']")
    assert _weights_column(page) == expected(1, 3, 2)
    assert page.locator("#explorer tbody tr.masked").count() == 3  # keys after "sat" are hidden
    assert requests == [target.as_uri()] and errors == []
    page.close()


def test_a_script_in_the_prompt_stays_text(browser, tmp_path):
    torch.manual_seed(3)
    model = GPT2Decoder(GPTConfig(vocab_size=40, context_length=16, emb_dim=16, n_heads=2, n_layers=1)).eval()
    evil = "<script>window.pwned = 1</script>"
    recorded = trace(model, torch.tensor([[1, 2, 3]]), tokens=["hi", evil, "<img src=x onerror=window.pwned=2>"])
    target = write_page(build_page(recorded, title=f"Attention: {evil}", subtitle="s", layer=0, head=1, query=2),
                        tmp_path / "evil.html")
    page, requests, errors = _open(browser, target)
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert page.inner_text("h1") == f"Attention: {evil}"
    assert evil in page.locator("#story-tokens span").all_inner_texts()
    assert evil in page.locator("#heat-row span").all_inner_texts()
    assert requests == [target.as_uri()] and errors == []
    page.close()


def test_generation_steps_show_the_cache_growing(browser, tmp_path):
    from qkv.trace.record.generation import trace_generation

    torch.manual_seed(4)
    model = GPT2Decoder(GPTConfig(vocab_size=12, context_length=16, emb_dim=16, n_heads=2, n_layers=1)).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    steps = trace_generation(model, prompt, 3, layer=0, head=1)
    tokens = [f"t{i}" for i in [1, 2, 3, 4] + [s.token_id for s in steps]]
    recorded = trace(model, prompt, tokens=tokens[:4])
    target = write_page(build_page(recorded, title="kv", subtitle="s", layer=0, head=1, query=3,
                                   generation=steps), tmp_path / "kv.html")
    page, requests, errors = _open(browser, target)
    rows = page.locator("#kv-steps tr")
    assert rows.count() == 4  # header + one row per generated token
    assert [rows.nth(i).locator("td:nth-child(3)").inner_text() for i in (1, 2, 3)] == ["4 + 1", "5 + 1", "6 + 1"]
    assert [rows.nth(i).locator("td:nth-child(4) span").count() for i in (1, 2, 3)] == [5, 6, 7]
    assert requests == [target.as_uri()] and errors == []
    page.close()


def test_the_weight_matrix_picks_queries_and_explains_cells(browser, tmp_path):
    recorded = book_trace(causal=True)
    target = write_page(build_page(recorded, title="book", subtitle="s", layer=0, head=0, query=1, book=True),
                        tmp_path / "matrix.html")
    page, requests, errors = _open(browser, target)
    assert page.locator("#matrix tr.qrow").count() == 6
    assert page.locator("#matrix th.ktok").all_inner_texts() == list(BOOK_TOKENS)
    page.click("#matrix tr.qrow[data-query='5']")  # x(6), "step"
    step = run_walkthrough(query_position=6, causal=True)
    assert _weights_column(page) == [f"{w:.4f}" for w in step.weights.tolist()]
    assert page.locator("#matrix tr.active th").inner_text() == "step"
    page.hover("#matrix tr.qrow[data-query='2'] td[data-key='1']")  # "starts" looking at "journey"
    starts = run_walkthrough(query_position=3, causal=True)
    assert page.inner_text("#detail") == (
        f"query “starts”, key 2 “journey”: q · k = {starts.scores[1]:.4f}, weight = {starts.weights[1]:.4f}")
    assert requests == [target.as_uri()] and errors == []
    page.close()


def _vec(values) -> str:
    return "[" + ", ".join("-inf" if v == float("-inf") else f"{v:.4f}" for v in values) + "]"


def _step_rows(page, number: int) -> list[tuple[str, str]]:
    cells = page.locator(f"#step-{number} table.values tr")
    return [(cells.nth(i).locator("th").inner_text(), cells.nth(i).locator("td").inner_text())
            for i in range(cells.count())]


def test_every_story_step_shows_all_of_its_values(browser, tmp_path):
    """As the terminal and --json do: every token's input, every row of the three
    projections, every key, every product, the scores, weights, values and the context."""
    recorded = book_trace()
    target = write_page(build_page(recorded, title="book", subtitle="s", layer=0, head=0, query=1, book=True),
                        tmp_path / "steps.html")
    page, requests, errors = _open(browser, target)
    w = run_walkthrough(query_position=2)
    tokens = list(BOOK_TOKENS)
    assert _step_rows(page, 1) == [(t, _vec(x)) for t, x in zip(tokens, w.inputs.tolist())]
    assert _step_rows(page, 2) == [
        (f"{name} row {i + 1}", _vec(r))
        for name, m in (("W_query", w.W_query), ("W_key", w.W_key), ("W_value", w.W_value))
        for i, r in enumerate(m.tolist())
    ]
    assert _step_rows(page, 3) == [(f"k({s + 1}) {t}", _vec(k)) for s, (t, k) in enumerate(zip(tokens, w.keys.tolist()))]
    assert _step_rows(page, 4) == [("q(2)", _vec(w.query.tolist()))]
    products = (w.keys * w.query).tolist()
    assert _step_rows(page, 5) == [(f"q ⊙ k({s + 1}) {t}", _vec(p)) for s, (t, p) in enumerate(zip(tokens, products))] + [
        ("q · k", _vec(w.scores.tolist()))]
    assert _step_rows(page, 6) == [("q · k / sqrt(2)", _vec(w.scaled_scores.tolist()))]
    assert _step_rows(page, 7) == [("softmax", _vec(w.weights.tolist()))]
    assert _step_rows(page, 8) == [(f"v({s + 1}) {t}", _vec(v)) for s, (t, v) in enumerate(zip(tokens, w.values.tolist()))]
    assert _step_rows(page, 9) == [("context", "[0.3061, 0.8210]")]  # the book's printed context
    assert page.locator("#step-10").count() == 0  # one head, no output projection
    assert requests == [target.as_uri()] and errors == []
    page.close()


def test_a_model_pages_steps_show_every_token_and_shorten_long_vectors_saying_so(browser, tmp_path):
    torch.manual_seed(2)
    model = GPT2Decoder(GPTConfig(vocab_size=40, context_length=16, emb_dim=16, n_heads=4, n_layers=1)).eval()
    tokens = ["The", "cat", "sat", "on", "the", "mat"]
    recorded = trace(model, torch.tensor([[3, 4, 5, 6, 3, 7]]), tokens=tokens)
    target = write_page(build_page(recorded, title="gpt", subtitle="s", layer=0, head=2, query=4),
                        tmp_path / "gpt.html")
    page, requests, errors = _open(browser, target)
    layer = recorded.layers[0]
    inputs = _step_rows(page, 1)
    assert [label for label, _ in inputs] == tokens
    assert inputs[0][1] == _vec(layer.x[0, 0, :8].tolist())[:-1] + ", … (16 in all)]"
    projections = _step_rows(page, 2)
    assert len(projections) == 3 * (8 + 1) and projections[8] == ("…", "8 more rows (16 in all)")
    assert [label for label, _ in _step_rows(page, 3)] == [f"k({s + 1}) {t}" for s, t in enumerate(tokens)]
    assert _step_rows(page, 3)[1][1] == _vec(layer.keys[0, 2, 1].tolist())
    assert _step_rows(page, 10) == [("output", _vec(layer.output[0, 4, :8].tolist())[:-1] + ", … (16 in all)]")]
    assert requests == [target.as_uri()] and errors == []
    page.close()
