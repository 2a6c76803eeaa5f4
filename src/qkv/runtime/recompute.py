"""A session without a KV cache: every step runs each row's whole sequence again.

    with RecomputeSession(model, batch_size=B) as session:      # window=None
        logits = session.prefill_row(row, ids (T,))              # (V,)
        logits = session.decode(tokens (b,), rows=[...])         # (b, V)

It has the interface of `qkv.runtime.DecodeSession`'s slot calls, so the one decode loop
(qkv.generation.decode_loop) drives it as it drives a cached session. Two uses: the
reference a cache must reproduce (`generate(..., use_cache=False)`), and generating past
the context length of a model with learned positions (`window=context_length`): each
token is then predicted from the row's last `window` tokens, re-run from position 0, as the
book's `generate_text_simple` crops its context.

Shape legend: B batch (rows), T tokens of a row, W window, V vocabulary.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder


class RecomputeSession:
    decodes_rows = True

    def __init__(self, model: CausalDecoder, *, batch_size: int = 1, window: int | None = None) -> None:
        if batch_size < 1:
            raise QkvError(f"batch_size must be at least 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self.window = window
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]
        self._was_training = model.training
        self.device = next(model.parameters()).device

    def __enter__(self) -> RecomputeSession:
        self._was_training = self.model.training
        self.model.eval()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.model.train(self._was_training)

    def _last_logits(self, rows: list[int]) -> Tensor:
        """Each row's logits after its last token, (b, V): the rows' tokens (the last
        `window` of them) padded at the end to one length and run together."""
        seqs = [self.rows[r] if self.window is None else self.rows[r][-self.window:] for r in rows]
        width = max(len(s) for s in seqs)
        if self.window is None and width > self.model.context_length:
            raise QkvError(f"{width} tokens exceed the model's context length ({self.model.context_length})")
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)  # (b, T)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq, device=self.device)
        ends = torch.tensor([len(s) - 1 for s in seqs], device=self.device)  # (b,)
        with torch.inference_mode():
            logits = self.model(ids)  # (b, T, V): causal, so a row's padding after it changes nothing
        return logits[torch.arange(len(rows), device=self.device), ends]  # (b, V)

    def prefill_row(self, row: int, ids: Tensor) -> Tensor:
        """Row `row` starts with ids (T,): the logits after its last token, (V,)."""
        if not 0 <= row < self.batch_size or ids.dim() != 1 or ids.shape[0] < 1:
            raise QkvError(f"prefill_row takes a row in 0..{self.batch_size - 1} and ids (T,), got {row}, "
                           f"{tuple(ids.shape)}")
        self.rows[row] = [int(t) for t in ids.tolist()]
        return self._last_logits([row])[0]

    def decode(self, tokens: Tensor, rows: list[int] | None = None) -> Tensor:
        """Each row's newest token appended -> its next logits (b, V)."""
        rows = list(range(self.batch_size)) if rows is None else rows
        if tokens.shape != (len(rows),):
            raise QkvError(f"decode takes one token per row, shape ({len(rows)},); got {tuple(tokens.shape)}")
        for row, token in zip(rows, tokens.tolist()):
            self.rows[row].append(int(token))
        return self._last_logits(rows)

    def release_row(self, row: int) -> None:
        self.rows[row] = []
