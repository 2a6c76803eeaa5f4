"""Model text made safe for a terminal: control characters shown, never obeyed.

A tokenizer's decoder is part of a stranger's file, and a model can emit any token: a
reply holding `\x1b]0;title\x07` or `\x1b[2J` would retitle or clear the user's terminal
(and other sequences can do worse). `escape_controls` writes every C0 control except
newline and tab, DEL, every C1 control and the Unicode bidirectional overrides (which
reorder what the terminal shows) as visible `\\xNN` / `\\uNNNN` escapes. `qkv generate`,
`qkv chat` and `qkv explain` print model text only through it, to a terminal or a pipe
alike (a file that is later `cat` reaches the terminal too).

Shape legend: none (text in, text out).
"""

from __future__ import annotations

import re

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` with control characters (module docstring) written as visible escapes."""
    return _CONTROLS.sub(_escape, text)
