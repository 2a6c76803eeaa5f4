"""qkv.util.terminal_text: every control character the terminal would obey is escaped, every
other character is left as it is (unicodedata's categories as the reference)."""

from __future__ import annotations

import re
import unicodedata

from hypothesis import given, strategies as st

from qkv.util.terminal_text import escape_controls

BIDI = {chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]}


def _obeyed(c: str) -> bool:
    return (unicodedata.category(c) == "Cc" and c not in "\n\t") or c in BIDI


@given(st.text())
def test_controls_are_escaped_and_nothing_else_changes(text: str) -> None:
    out = escape_controls(text)
    assert not any(_obeyed(c) for c in out)
    expected = "".join((f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}") if _obeyed(c) else c for c in text)
    assert out == expected


def test_the_issues_sequence_is_shown_not_sent() -> None:
    assert escape_controls("hi\x1b]0;pwned\x07\x1b[2J\n") == "hi\\x1b]0;pwned\\x07\\x1b[2J\n"
    assert re.fullmatch(r"[ -~\n]*", escape_controls("\r\x9b\x7f"))
