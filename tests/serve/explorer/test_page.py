"""What a learner sees in the explorer (headless Chromium against a real `qkv serve` on a
tiny Llama with grouped-query attention): masked keys without scores, a legend, the query
row marked, the context as its length and first values, the analysis the endpoint returns,
positions from 1, no stale results under an error, the Chat tab marked and the message shown."""

from __future__ import annotations

import math

import pytest
import torch
from playwright.sync_api import expect

from qkv.trace import trace
from qkv.trace.explain.analysis import key_norms, sink_share
from qkv.trace.record.export import query_row

from tests.serve.explorer.test_browser import browser, traced_page  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.browser
TEXT = "The cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def explorer(browser, start_server):  # noqa: F811
    running = start_server(api_key=None)
    page, outside, errors = traced_page(browser, running.url, TEXT)
    yield page, running.served
    assert outside == [] and errors == []
    page.close()


def _reference(served, layer: int, head: int, position: int):
    ids = served.tokenizer.encode(TEXT).ids
    recorded = served.engine.call(lambda: trace(served.model, torch.tensor([ids]), layer=[layer], head=None,
                                                query=[position - 1])).result(60)
    focus = recorded.layer(layer)
    return focus, query_row(focus, None, head, position - 1)


def test_masked_keys_show_no_score_and_the_query_row_is_marked(explorer):
    page, served = explorer
    with page.expect_response("**/explorer/trace"):
        page.select_option("#head", "3")
    with page.expect_response("**/explorer/trace"):
        page.select_option("#query", "4")  # x(4), counted from 1
    expect(page.locator("#summary")).to_contain_text("head 3 (kv head 1), query x(4)")  # drawn, not only answered
    focus, row = _reference(served, 0, 3, 4)
    rows = page.locator("#keys tbody tr")
    assert rows.count() == len(row["weights"])
    assert page.locator("#keys tbody tr.query td:nth-child(1)").inner_text() == "4"
    for s in range(rows.count()):
        score, scaled, weight = (rows.nth(s).locator(f"td:nth-child({c})").inner_text() for c in (3, 4, 5))
        if row["visible"][s]:
            assert (score, scaled, weight) == (f"{row['scores'][s]:.4f}", f"{row['scaled_scores'][s]:.4f}",
                                               f"{row['weights'][s]:.4f}")
        else:  # a future key: masked, no number but its zero weight
            assert (score, scaled, weight) == ("masked", "masked", "0.0000")
    assert page.locator("#keys tbody tr.masked").count() == row["visible"].count(False) > 0
    assert page.inner_text("#summary").startswith("layer 0, head 3 (kv head 1), query x(4)")


def test_legend_context_and_analysis(explorer):
    page, served = explorer
    terms = page.locator("#legend dt").all_inner_texts()
    for term in ("score q·k", "scaled", "weight", "masked", "context", "␣ ↵ →"):
        assert term in terms
    with page.expect_response("**/explorer/trace"):
        page.select_option("#layer", "1")
    expect(page.locator("#summary")).to_contain_text("layer 1,")
    head, position = int(page.input_value("#head")), int(page.input_value("#query"))
    focus, row = _reference(served, 1, head, position)
    context = row["context"]
    shown = page.inner_text("#context")
    norm = math.sqrt(sum(v * v for v in context))
    assert shown == (f"|c| = {norm:.4f}, [" + ", ".join(f"{v:.4f}" for v in context[:4]) + f", …] ({len(context)} values)")
    assert page.eval_on_selector("#context-values", "e => e.textContent") == (
        "[" + ", ".join(f"{v:.4f}" for v in context) + "]")  # all of them, folded away
    assert page.locator("#sink td").all_inner_texts() == [f"{v:.3f}" for v in sink_share(focus).values()]
    assert page.locator("#sink td.current").all_inner_texts() == [f"{sink_share(focus)[head]:.3f}"]
    groups = page.locator("#kv-groups tr").all_inner_texts()
    assert len(groups) == 1 + focus.num_kv_heads and "0, 1" in groups[1] and "2, 3" in groups[2]
    norms = page.locator("#key-norms tr")
    assert norms.nth(0).locator("th").all_inner_texts()[1:] == [str(s + 1) for s in range(len(row["weights"]))]
    assert norms.nth(2).locator("td").all_inner_texts() == [f"{n:.2f}" for n in key_norms(focus)]
    assert page.locator("#rope tr").count() == 2 and "x(1)" in page.inner_text("#analysis")


def test_an_error_clears_the_old_results(explorer):
    page, _ = explorer
    assert page.locator("#keys tbody tr").count() > 0
    page.fill("#text", "   ")
    with page.expect_response("**/explorer/trace"):
        page.click("#run")
    expect(page.locator("#error")).to_contain_text("'text' must be a non-empty string")
    assert page.locator("#keys tbody tr").count() == 0
    assert page.inner_text("#summary") == "" and page.locator("#analysis *").count() == 0
    assert not page.is_visible("#results")
    page.fill("#text", TEXT)
    with page.expect_response("**/explorer/trace"):
        page.click("#run")
    expect(page.locator("#results")).to_be_visible()
    assert page.inner_text("#error") == "" and page.locator("#keys tbody tr").count() > 0


def test_the_chat_tab_is_marked_and_shows_the_users_message(explorer):
    page, _ = explorer
    assert page.get_attribute("#tab-explore", "aria-selected") == "true"
    page.click("#tab-chat")
    assert "on" in page.get_attribute("#tab-chat", "class").split()
    assert "on" not in (page.get_attribute("#tab-explore", "class") or "").split()
    assert page.get_attribute("#tab-chat", "aria-selected") == "true"
    page.fill("#message", "What is a <b>key</b>?")
    page.fill("#max-tokens", "4")
    page.click("#send")
    page.wait_for_selector("#reply[data-done]", state="attached", timeout=30000)
    assert page.inner_text("#chat-error") == ""
    assert page.inner_text("#you") == "You: What is a <b>key</b>?"  # as text, not markup
    assert page.locator("#transcript b").count() == 0
    page.click("#tab-explore")
    assert "on" in page.get_attribute("#tab-explore", "class").split() and page.is_visible("#explore")
