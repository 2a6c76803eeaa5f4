"""Token ids as `qkv explain` and the explorer show them (the answers' incremental text is
qkv.generation.detokenize)."""

from __future__ import annotations

from typing import Any

from qkv.util.terminal_text import escape_controls


def display_tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    """Readable token texts (as `qkv explain` shows them): leading space as ␣, ↵ and →."""
    shown = []
    for token_id in ids:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if not text:
            text = tokenizer.id_to_token(token_id) or f"#{token_id}"
        text = escape_controls(text.replace("\n", "↵").replace("\t", "→").replace("\r", ""))
        shown.append("␣" + text[1:] if text.startswith(" ") else text)
    return shown
