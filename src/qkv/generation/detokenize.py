"""Token ids -> text as it grows, in O(1) amortised per token: the one incremental
detokenizer of `qkv generate`, `qkv chat` and the server.

    stream = TextStream(tokenizer, stop=["\\n\\n"], context=prompt_ids[-4:])
    for token in tokens:
        send(stream.push(token))    # text safe to hand out now ("" while some is held back)
        if stream.stopped: break
    send(stream.flush())            # the rest, at the end of the answer

Each push decodes only a short window of tokens, twice: `ids[prefix:read]` (already turned
into text) and `ids[prefix:]`; the difference is new text (vLLM's prefix and read offsets).
The window starts a few tokens back (the `context`, or the previous piece) so spacing that
depends on the token before (SentencePiece's leading space) is what decoding everything
gives. Text ending in U+FFFD is a character whose remaining bytes are still to come: it is
held back, and a run of invalid bytes that never completes is handed out at the first token
boundary that splits it cleanly, so the window stays a few tokens long. Special tokens are
skipped (as decode(..., skip_special_tokens=True) skips them) without entering the window.

Stop strings are searched in the new text plus the last (longest stop - 1) characters
already handed out, so one split across tokens is found where a search of the whole text
finds it; that many characters wait until no stop string can start in them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

_UNFINISHED = "\ufffd"  # what a lone part of a multi-byte character decodes to
_SETTLE_AFTER = 4  # tokens held behind U+FFFD before a clean split is looked for (a character has <= 4 bytes)


_SPECIAL: dict[int, tuple[Any, frozenset[int]]] = {}  # id(tokenizer) -> (the tokenizer, its special ids)
_SPECIAL_KEPT = 8  # tokenizers remembered (a process serves one or two)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids decoding skips (added tokens marked special), read once per tokenizer: the
    tokenizers library builds its whole added-token table on every ask (Gemma 3's 6,384
    entries: about 2.5 ms, on the server's event loop for every request)."""
    kept = _SPECIAL.get(id(tokenizer))
    if kept is not None and kept[0] is tokenizer:
        return kept[1]
    added = getattr(tokenizer, "get_added_tokens_decoder", dict)()  # {id: AddedToken}
    special = frozenset(token for token, added_token in added.items() if added_token.special)
    if len(_SPECIAL) >= _SPECIAL_KEPT:
        _SPECIAL.pop(next(iter(_SPECIAL)))
    _SPECIAL[id(tokenizer)] = (tokenizer, special)
    return special


class TextStream:
    """Feed token ids one by one (module docstring); `push` answers the text to send now.

    `sent`: characters handed out; `text_length`: the text so far, cut at a stop string
    (sent plus what is held back); `decoded_length`: len(decode(all ids pushed)), uncut.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), context: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._special = special_ids(tokenizer)
        self._window = [t for t in context if t not in self._special]  # ids[prefix:]
        self._read = len(self._window)  # window[:read] is text already (the context's, or handed on)
        self._before: str | None = None  # decode(window[:read]), once computed
        self._made = 0  # characters the window has handed on
        self.decoded_length = 0
        self._pending = ""  # handed on, not out: the start of a possible stop string
        self._tail = ""  # the last `_hold` characters handed out
        self.sent = 0
        self.stopped = False

    @property
    def text_length(self) -> int:
        return self.sent + len(self._pending)

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        if token not in self._special:  # skipped by decoding, so no part of the window
            self._window.append(token)
            self._pending += self._new_text(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """The rest at the end of the answer (an unfinished character as U+FFFD), cut at a
        stop string that the held-back text completes."""
        if self.stopped:
            return ""
        self._pending += self._new_text(final=True)
        return self._release(final=True)

    # -- the window --------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _new_text(self, *, final: bool) -> str:
        """The text the window's unread tokens add, if it is safe to hand on (or `final`)."""
        window, read = self._window, self._read
        if read == len(window):
            return ""
        if self._before is None:
            self._before = self._decode(window[:read])
        before, after = self._before, self._decode(window)
        self.decoded_length = self._made + len(after) - len(before)
        if final or (after.startswith(before) and not after.endswith(_UNFINISHED)):
            return self._advance(len(window), before, after)
        if len(window) - read > _SETTLE_AFTER:  # a run of invalid bytes: hand on what is settled
            for split in range(read + 1, len(window)):
                left = self._decode(window[:split])
                if left.startswith(before) and left + self._decode(window[split:]) == after:
                    return self._advance(split, before, left)
        return ""

    def _advance(self, split: int, before: str, text: str) -> str:
        """window[:split] decodes to `text`: hand on its new part; the next window starts
        where this piece does (its context), or stays where it is if the piece is empty."""
        new = text[len(before):]
        if new:
            self._window = self._window[self._read:]
            split -= self._read
        self._read = split
        self._before = None
        self._made += len(new)
        return new

    # -- stop strings ------------------------------------------------------------------
    def _release(self, *, final: bool) -> str:
        if self.stop and self._pending:
            seen = self._tail + self._pending
            found = [at for at in (seen.find(s) for s in self.stop) if at != -1]
            if found:
                self._pending = seen[:min(found)][len(self._tail):]
                self.stopped = final = True
        end = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        piece, self._pending = self._pending[:end], self._pending[end:]
        if piece:
            self.sent += len(piece)
            self._tail = (self._tail + piece)[-self._hold:] if self._hold else ""
        return piece
