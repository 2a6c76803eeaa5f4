"""qkv.chat.sandbox: integer powers and products are refused before they are computed (one
big-integer operation is a single C call no deadline can interrupt), and templates that do
ordinary arithmetic render what Jinja2's own unsandboxed environment renders (the reference)."""

from __future__ import annotations

import time

import pytest
from jinja2 import Environment

from qkv.chat.sandbox import MAX_INT_BITS, TemplateLimitError, chat_environment, render
from tests.conftest import CHAT_TEMPLATE

BOMBS = [
    "{{ 9 ** (9 ** 9) }}",  # Python's 9 ** 9 ** 9: 1.2 billion bits, minutes in one C call
    "{{ 2 ** 100000 }}",
    "{{ (10 ** 1000) * (10 ** 1000) }}",  # each factor is allowed, the product is not
    "{{ ((2 ** 64) ** 64) ** 64 }}",
    "{% set a = 2 ** 60 %}{% set b = a * a * a * a * a * a * a * a %}{{ b * b * b * b * b * b * b * b * b * b }}",
    "{% set ns = namespace(x=3) %}{% for _ in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
]


@pytest.mark.parametrize("source", BOMBS)
def test_huge_integers_are_refused_fast_and_by_name(source: str) -> None:
    env = chat_environment()
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=f"an integer of about .* bits \\(at most {MAX_INT_BITS:,}\\)"):
        render(env.bounded_template(source))
    assert time.monotonic() - start < 1.0


ORDINARY = [
    CHAT_TEMPLATE,
    "{{ 9 ** 9 ** 9 }}",  # Jinja2's ** groups from the left: (9 ** 9) ** 9, a 257-bit number
    "{{ 10 ** 1000 }}|{{ (2 ** 64) ** 64 }}|{{ 2 ** -3 }}|{{ 1 ** 1000000 }}|{{ 0 ** 99999999 }}|{{ (-1) ** 99999999 }}",
    "{{ 'ab' * 3 }}{{ [1, 2] * 2 }}{{ 3 * 4 }}{{ 2.5 * 2 }}{{ 1.5 ** 10 }}{{ 0 * (10 ** 1000) }}",
    "{% for m in messages %}{{ loop.index0 % 2 }}{{ (messages | length) * 2 }}{{ m['content'] * 2 }}{% endfor %}",
]
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize("source", ORDINARY)
def test_ordinary_templates_render_what_jinja2_renders(source: str) -> None:
    variables = {"messages": MESSAGES, "add_generation_prompt": True}
    reference = Environment(trim_blocks=True, lstrip_blocks=True).from_string(source).render(**variables)
    assert render(chat_environment().bounded_template(source), **variables) == reference
