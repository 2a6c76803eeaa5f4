"""The key anatomy page in Chromium: captions in words (not file names), every figure loaded
and shown whole within the page's width, the column key present, nothing fetched."""

from __future__ import annotations

import pytest
import torch

from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.trace.render.html import write_page
from qkv.trace.explain.keys import key_anatomy, summary_rows
from qkv.trace.render.keys_figures import CAPTIONS, keys_figures, keys_page
from qkv.trace.render.png import render_pngs

from .test_html_browser import _open, browser  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.browser


def test_key_page_captions_and_whole_figures(browser, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    anatomy = key_anatomy(LlamaForCausalLM(cfg).eval(), torch.randint(0, 97, (1, 20)), name="tiny")
    images = render_pngs(keys_figures(anatomy))
    target = write_page(keys_page(anatomy, summary_rows(anatomy), images), tmp_path / "keys.html")
    page, requests, errors = _open(browser, target)
    page.set_viewport_size({"width": 900, "height": 800})
    captions = page.locator("figcaption").all_inner_texts()
    assert captions == [f"{CAPTIONS[stem]} ({stem}.png)" for stem in images]
    sizes = page.eval_on_selector_all("figure img", "imgs => imgs.map(i => [i.naturalWidth, i.clientWidth, "
                                      "i.getBoundingClientRect().right, document.documentElement.clientWidth])")
    assert len(sizes) == len(images)
    for natural, shown, right, page_width in sizes:
        assert natural > 0 and 0 < shown and right <= page_width  # loaded, and whole on the page
    legend = page.inner_text("p.legend")
    for term in ("Stability:", "First key norm / median:", "Sink mass:", "channel i turns together with channel i + 8"):
        assert term in legend
    assert requests == [target.as_uri()] and errors == []
    page.close()
