"""The book's six-token example as a recorded layer, built from the lead walkthrough.

`qkv.book.walkthrough.run_walkthrough` computes the book's steps for one query (seeded exactly
as the book seeds them, checked against the kernel); running it for every query position
gives the whole (T, T) picture that the figures and the HTML page draw.

Shape legend: T tokens, D = d_out.
"""

from __future__ import annotations

import torch

from qkv.trace.record.recorder import LayerTrace, Trace
from qkv.book.walkthrough import BOOK_D_OUT, BOOK_SEED, BOOK_TOKENS, book_inputs, run_walkthrough


def book_trace(*, d_out: int = BOOK_D_OUT, seed: int = BOOK_SEED, causal: bool = False) -> Trace:
    inputs = book_inputs()
    walks = [
        run_walkthrough(inputs, BOOK_TOKENS, query_position=p, d_out=d_out, seed=seed, causal=causal)
        for p in range(1, len(BOOK_TOKENS) + 1)
    ]
    first = walks[0]
    q = torch.stack([w.query for w in walks])[None, None]  # (1, 1, T, D)
    keys = first.keys[None, None]  # (1, 1, T, D)
    values = first.values[None, None]
    context = torch.stack([w.context for w in walks])[None, None]  # (1, 1, T, D)
    layer = LayerTrace(
        index=0, name="", kind="book example", num_heads=1, num_kv_heads=1, head_dim=d_out,
        heads=[0], kv_heads=[0], queries=list(range(len(walks))), cache_length=0,
        scale=float(d_out) ** -0.5, causal=causal, rope=False, x=inputs[None],
        W_query=first.W_query, W_key=first.W_key, W_value=first.W_value,
        b_query=None, b_key=None, b_value=None, q_unrotated=q, q=q, k_unrotated=keys,
        keys=keys, values=values,
        scores=torch.stack([w.scores for w in walks])[None, None],  # (1, 1, T, T)
        scaled=torch.stack([w.scaled_scores for w in walks])[None, None],
        mask=torch.stack([w.visible for w in walks])[None, None],
        weights=torch.stack([w.weights for w in walks])[None, None],
        context=context, concat=context[:, 0], output=context[:, 0],
    )
    return Trace(layers=[layer], output=context[0, 0], tokens=list(BOOK_TOKENS))
