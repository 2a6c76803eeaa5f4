"""Which layer, head and query the reader picked: positions counted from 1 (as the book
writes x(2)) or a token's text, layers and heads from 0 (as transformers counts them).

Kept apart from the model code, with no heavy imports, so that `qkv explain` on the book's
example does not wait for tokenizers and the tracer to load.
"""

from __future__ import annotations

from qkv.errors import QkvError


def resolve_query(query: str | None, tokens: list[str], default: int) -> int:
    """Index from 0 of the query token: a position counted from 1, or the token's text."""
    if query is None:
        return default
    text = query.strip()
    if text.lstrip("-").isdigit():
        position = int(text)
        if not 1 <= position <= len(tokens):
            raise QkvError(
                f"--query {position}: positions are counted from 1, between 1 and {len(tokens)}"
            )
        return position - 1
    wanted = text.lower()
    for i, token in enumerate(tokens):
        if token.replace("␣", "").lstrip("#").strip().lower() == wanted.lstrip("#"):
            return i
    listed = ", ".join(f'{i + 1}:"{t}"' for i, t in enumerate(tokens[:40]))
    raise QkvError(f"--query {query!r} is neither a position nor one of the tokens ({listed})")


def check_range(value: int | None, count: int, option: str, subject: str, noun: str) -> None:
    """`value` (None: not given) must index one of `count` things, counted from 0."""
    if value is not None and not 0 <= value < count:
        valid = "0 is the only choice" if count == 1 else f"0..{count - 1}, counted from 0"
        raise QkvError(f"{option} {value} is out of range: {subject} has {count} {noun} ({valid})")
