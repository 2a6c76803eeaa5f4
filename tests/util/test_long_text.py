"""The long text: long enough for the measurements that need it, and the same every time."""

from __future__ import annotations

import subprocess
import sys

from qkv.util.long_text import long_text, long_text_source


def test_the_long_text_is_long_english_and_stable() -> None:
    text = long_text()
    assert text == long_text()
    assert len(text) > 300_000  # > 20k tokens of any English tokenizer (about 4 characters a token)
    assert "Assignment statements" in text and "pydoc_data.topics" in long_text_source()
    words = text.split()
    assert sum(word.isalpha() for word in words) / len(words) > 0.5  # mostly words, not code


def test_it_prints_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "qkv.util.long_text"], capture_output=True, text=True, check=True)
    assert out.stdout == long_text()
