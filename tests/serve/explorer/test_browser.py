"""The explorer page in headless Chromium (Debian's), against the real server: type text,
pick layer/head/query, see qkv.trace's weights; user text stays inert; the chat tab streams."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from qkv.trace import trace
from qkv.trace.record.export import query_row

pytestmark = pytest.mark.browser
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium not found: browser tests must run in CI")
        pytest.skip("Chromium not found (Debian package `chromium`): browser tests skipped")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True, args=FLAGS)
        yield launched
        launched.close()


def traced_page(browser, url: str, text: str):
    """A page on the explorer at `url`, allowed to fetch from the server only, with `text`
    typed and traced: (page, URLs it tried elsewhere, page errors)."""
    page = browser.new_page()
    outside: list[str] = []
    errors: list[str] = []

    def route(r):
        if r.request.url.startswith(url):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(str(e)))
    with page.expect_response("**/explorer/trace"):
        page.goto(url + "/")
    page.fill("#text", text)
    with page.expect_response("**/explorer/trace"):
        page.click("#run")
    return page, outside, errors


def test_typed_text_shows_the_traced_weights_and_chat_streams(browser, start_server) -> None:
    running = start_server(api_key=None)
    served = running.served
    text = "The cat <b>sat</b> on the mat"
    page, outside, errors = traced_page(browser, running.url, text)
    with page.expect_response("**/explorer/trace"):
        page.select_option("#layer", "1")
    with page.expect_response("**/explorer/trace"):
        page.select_option("#head", "2")
    with page.expect_response("**/explorer/trace"):
        page.select_option("#query", "5")  # the query's position, counted from 1
    ids = served.tokenizer.encode(text).ids
    row = served.engine.call(lambda: query_row(
        trace(served.model, torch.tensor([ids]), layer=[1], head=[2], query=[4]).layer(1), None, 2, 4)).result(60)
    shown = page.locator("#keys tbody td.weight").all_inner_texts()
    assert shown == [f"{w:.4f}" for w in row["weights"]]
    assert page.locator("#keys b").count() == 0  # user text is text, not markup
    # The chat tab streams the same answer the API gives.
    page.click("#tab-chat")
    page.fill("#message", "What is attention?")
    page.fill("#max-tokens", "12")
    page.click("#send")
    expected = httpx.post(running.url + "/v1/chat/completions", timeout=60, json={
        "model": served.name, "messages": [{"role": "user", "content": "What is attention?"}], "max_tokens": 12,
        "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert expected  # a reply to compare with
    page.wait_for_selector("#reply[data-done]", state="attached", timeout=30000)
    assert page.inner_text("#chat-error") == ""
    assert page.eval_on_selector("#reply", "e => e.textContent") == expected
    assert outside == [] and errors == []
    page.close()


def test_clicking_a_key_row_shows_its_score_split(browser, start_server) -> None:
    from qkv.trace.explain.attribution import attribute

    running = start_server(api_key=None)
    served = running.served
    text = "The cat sat on the mat"
    page, _, errors = traced_page(browser, running.url, text)
    with page.expect_response("**/explorer/why"):
        page.locator("#keys tbody tr.key").nth(1).click()
    page.wait_for_selector("#why table.why-terms")
    ids = served.tokenizer.encode(text).ids
    reference = served.engine.call(lambda: attribute(served.model, torch.tensor([ids]), layer=0, head=0,
                                                     query=len(ids) - 1, keys=[1])).result(60)
    first = page.locator("#why table.why-terms tr").nth(1).locator("td").all_inner_texts()
    q, k, term = reference.top_pairs(1, 1)[0]
    assert first == [q, k, f"{term:.4f}", f"{term * reference.scale:.4f}"]
    assert "(exact)" in page.locator("#why p").inner_text() and not errors


def test_on_int4_the_split_is_labelled_with_the_served_score(browser, start_server) -> None:
    """SmolLM2's default precision: the page says the split is of the float weights the int4
    blocks stand for and shows the served model's own score beside it (qkv.serve.explorer.why)."""
    running = start_server(api_key=None, precision="int4")
    page, _, errors = traced_page(browser, running.url, "The cat sat on the mat")
    assert "Click a key's row" in page.inner_text("#results")
    with page.expect_response("**/explorer/why") as answer:
        page.locator("#keys tbody tr.key").nth(1).click()
    page.wait_for_selector("#why table.why-terms")
    served = answer.value.json()["served"]
    note = page.locator("#why p").inner_text()
    assert "float weights that int4" in note and f"{served['score']:.4f}" in note and not errors
