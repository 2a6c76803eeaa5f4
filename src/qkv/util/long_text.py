"""A long English text that every machine with Python has, for measurements over tens of
thousands of tokens (the book's the-verdict.txt is about 5,000).

    long_text() -> str      python -m qkv.util.long_text > long.txt

It is the Python Language Reference's topics as CPython ships them in `pydoc_data.topics`
(what `help("assignment")` prints): about 465,000 characters of technical English prose
with some grammar rules and examples, over 100,000 SmolLM2 tokens. Topics are joined in
name order, so the text is the same for a given Python version (`long_text_source` names it).
"""

from __future__ import annotations

import platform


def long_text() -> str:
    """Every pydoc topic, in name order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"


def long_text_source() -> str:
    """Where `long_text` comes from, for a results table."""
    from pydoc_data.topics import topics

    return f"CPython {platform.python_version()} pydoc_data.topics ({len(topics)} topics, in name order)"


if __name__ == "__main__":
    import sys

    sys.stdout.write(long_text())
