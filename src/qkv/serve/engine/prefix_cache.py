"""Prompt-prefix reuse across requests (what llama.cpp's server calls cache reuse).

A slot row keeps the keys and values of its last request after that request ends: nothing
clears a freed row (SlotKVCache hides positions beyond a row's length). `RowPrefixes`
remembers which tokens each row holds, in order, so that a new request starts from the row
(free, or busy: a running request's prompt is final) sharing the longest prefix with its
prompt, and prefills only the rest:

    prefixes = RowPrefixes(slots=B)
    row, donor, kept = prefixes.pick(free_rows, prompt)   # kept: positions whose KV is reused
    session.copy_row(donor, row, kept)                    # when donor != row
    session.prefill_row(row, prompt[kept:], start=kept)
    prefixes.hold(row, prompt)                     # after the prefill
    prefixes.extend(row, token)                    # after each decode step writes `token`

With a long shared system prompt the first token then costs the new tokens only. At least
the prompt's last token is always prefilled again, since its logits pick the first new token.
A row whose cache may be inconsistent (a step that failed) is `forget`-ten.

Shape legend: B slots.
"""

from __future__ import annotations

import itertools

from qkv.runtime.prompt_parts import common_prefix


class RowPrefixes:
    """The token ids whose keys/values each slot row holds, and the row a prompt should take."""

    def __init__(self, slots: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: list[list[int]] = [[] for _ in range(slots)]
        self._used = [0] * slots  # when each row was last given out (least recently used goes first)
        self._clock = itertools.count(1)

    def pick(self, free: list[int], prompt: list[int]) -> tuple[int, int, int]:
        """(row, donor, kept): the free row to take, and the row (free or busy, maybe `row`
        itself) whose first `kept` positions it starts from, kept <= len(prompt) - 1.

        The donor is the row sharing the longest prefix with the prompt (a running request's
        prompt is final, so a busy row serves too). The row taken is a free one whose tokens
        the prompt would not lose (empty, or all within the shared prefix), else the least
        recently used: so a freed row keeps its conversation while other rows are free."""
        if not free:
            raise ValueError("no free row to pick from")
        if not self.enabled:
            row = min(free, key=lambda r: self._used[r])
            self._used[row] = next(self._clock)
            return row, row, 0
        common = [common_prefix(held, prompt) for held in self._held]
        shared = [min(n, len(prompt) - 1) for n in common]
        donor = max(range(len(shared)), key=lambda r: (shared[r], r in free))
        row = min(free, key=lambda r: (len(self._held[r]) > common[r], r != donor, self._used[r]))
        self._used[row] = next(self._clock)
        return row, donor, shared[donor]

    def hold(self, row: int, tokens: list[int]) -> None:
        """Row `row` now holds exactly `tokens` (its prompt, just prefilled)."""
        self._held[row] = list(tokens)

    def extend(self, row: int, token: int) -> None:
        """A decode step wrote `token` at row `row`'s next position."""
        self._held[row].append(token)

    def forget(self, row: int | None = None) -> None:
        """Row `row` (every row when None) holds nothing reusable."""
        for r in range(len(self._held)) if row is None else [row]:
            self._held[r] = []
