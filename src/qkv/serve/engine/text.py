"""Token ids -> text as it grows: incremental detokenizing and stop strings."""

from __future__ import annotations

from typing import Any

from qkv.util.terminal_text import escape_controls


class TextStream:
    """Feed token ids one by one; `push` answers the text that is safe to send now.

    Text ending in a partial UTF-8 character (U+FFFD) waits for the next token, and the
    tail that could still turn into a stop string waits too. When a stop string appears,
    the text is cut before it and `stopped` turns True.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (cut at a stop string)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        self._cut(text)
        end = len(self.text) if self.stopped else max(self.sent, len(self.text) - self._hold)
        return self._take(end)

    def flush(self) -> str:
        """The rest, at the end of the answer (an unfinished character included, as U+FFFD),
        cut at a stop string that the held-back text completes."""
        if not self.stopped and self.ids:
            self._cut(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        return self._take(len(self.text))

    def _cut(self, text: str) -> None:
        """`text` as the text so far, cut before the first stop string found since the last send."""
        self.text = text
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True

    def _take(self, end: int) -> str:
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece


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
