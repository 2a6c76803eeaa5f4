"""Tokens as OpenAI's logprobs show them: each token's text, its raw bytes, and where it
starts in the text of an answer.

A byte-level BPE token (GPT-2, SmolLM2, Qwen) may hold part of a UTF-8 character: its text
is then U+FFFD, as the tokenizer decodes it alone, and its bytes are the real bytes (from
the byte-to-character table such tokenizers use), so a client can join them back.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback (Llama)


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Text and bytes of token ids for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = "ByteLevel" in type(getattr(tokenizer, "decoder", None)).__name__
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token: int) -> str:
        return self._entry(token)[0]

    def bytes(self, token: int) -> list[int]:
        return self._entry(token)[1]

    def _entry(self, token: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token)
        if entry is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            piece = self.tokenizer.id_to_token(token) or ""
            table = _unicode_to_byte()
            match = _BYTE_TOKEN.fullmatch(piece)
            if self._byte_level and piece and all(ch in table for ch in piece):
                raw = [table[ch] for ch in piece]
            elif match:
                raw = [int(match.group(1), 16)]
            else:
                raw = list(text.encode("utf-8"))
            entry = self._cache[token] = (text, raw)
        return entry

    def starts(self, ids: list[int], *, skip_special: bool) -> list[int]:
        """Where each token of `ids` starts in the text of all of them: len(decode(ids[:i]))."""
        prefixes = self.tokenizer.decode_batch([ids[:i] for i in range(len(ids))], skip_special_tokens=skip_special)
        return [len(p) for p in prefixes]
