"""The registry: every section name resolves to a function, DEFAULT is a subset in the
registry's order, and choosing sections keeps that order."""

from __future__ import annotations

import pytest

from qkv.bench import DEFAULT, SECTIONS, choose, section_function
from qkv.errors import QkvError


def test_registry_names() -> None:
    assert list(SECTIONS) == ["decode", "roofline", "prefill", "cache", "kv_bytes", "attention", "plot",
                              "smollm2", "quality", "startup", "kv-cache", "kv-window"]
    assert set(DEFAULT) <= set(SECTIONS)
    assert list(DEFAULT) == [name for name in SECTIONS if name in DEFAULT]


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_resolves_to_a_function(name: str) -> None:
    assert callable(section_function(name))


def test_choose_keeps_the_registry_order_and_rejects_unknown_names() -> None:
    assert choose(None) == list(DEFAULT)
    assert choose(["quality,smollm2", "decode"]) == ["decode", "smollm2", "quality"]
    with pytest.raises(QkvError, match="unknown section nope"):
        choose(["decode,nope"])
