"""qkv.chat.template_process: a render in the child gives what the sandbox gives in-process (the
reference), the child's memory limit and the parent's deadline hold whatever the template
does, and a child that was killed is replaced for the next render."""

from __future__ import annotations

import time

import pytest

from qkv.chat.sandbox import chat_environment, render
from qkv.chat.template_process import TemplateProcess, TemplateProcessError

SOURCE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{% if not loop.last %}\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{{ messages | tojson(indent=2) }}")
MESSAGES = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "naïve café 東京 \u2603"}]


@pytest.fixture
def process():
    child = TemplateProcess()
    yield child
    child.close()


def test_the_child_renders_what_the_sandbox_renders(process: TemplateProcess) -> None:
    variables = {"messages": MESSAGES, "add_generation_prompt": True, "bos_token": "", "eos_token": ""}
    expected = render(chat_environment().bounded_template(SOURCE), **variables)
    assert process.render(SOURCE, variables) == expected


def test_an_allocation_past_the_memory_limit_is_refused_and_the_next_render_works(process: TemplateProcess) -> None:
    with pytest.raises(TemplateProcessError) as error:
        process.render("{{ ([('x'*1000000)]*2500)|join }}", {})
    assert error.value.kind == "memory"
    assert process.render("{{ 1 + 1 }}", {}) == "2"


def test_one_expensive_builtin_per_step_cannot_pass_the_deadline(process: TemplateProcess) -> None:
    sorts = "{% set l = ((range(100000)|list)*10)|reverse|list %}{% set x = [" + ", ".join(["l|sort"] * 60) + "] %}x"
    start = time.monotonic()
    with pytest.raises(TemplateProcessError) as error:
        process.render(sorts, {})
    assert error.value.kind in ("time", "limit") and time.monotonic() - start < 5
    assert process.render("ok", {}) == "ok"


def test_a_killed_child_is_replaced(process: TemplateProcess) -> None:
    assert process.render("a", {}) == "a"
    process._child.kill()
    process._child.wait()
    assert process.render("b", {}) == "b"


def test_a_template_that_does_not_parse_is_refused_by_kind(process: TemplateProcess) -> None:
    with pytest.raises(TemplateProcessError) as error:
        process.check("{% for %}")
    assert error.value.kind == "parse"


def test_a_callers_deadline_ends_the_render_and_its_child(process: TemplateProcess) -> None:
    """render_deadline (the server's prompt worker sets it): the render is stopped at the
    caller's deadline, not at the sandbox's later one, and no child is left running it."""
    from qkv.chat.template_process import render_deadline

    slow = "{% for i in range(1000) %}{{ (range(99999)|list|sort(reverse=true))|length }}{% endfor %}"
    assert process.render("warm", {}) == "warm"
    child = process._child
    start = time.monotonic()
    with render_deadline(start + 0.2), pytest.raises(TemplateProcessError) as error:
        process.render(slow, {})
    assert error.value.kind == "time" and time.monotonic() - start < 0.6
    assert child.poll() is not None  # killed, and waited for
    assert process.render("next", {}) == "next"  # a new child for the next render
