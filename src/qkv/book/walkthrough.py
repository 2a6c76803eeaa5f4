"""The book's section 3.4 walkthrough as data: one query scored against every key.

`run_walkthrough` seeds, draws W_query, W_key and W_value with `torch.rand(d_in, d_out)` in
that order (as the book does), and materialises every step for one query token: the keys
`inputs @ W_key`, the query, one dot-product score per key, the scores scaled by
1/sqrt(d_k), the softmax weights and the context vector. It then checks the result against
qkv's functional core (`explicit_attention`), so what is shown is what the library computes.

Shape legend: T tokens, d_in input features, d_out = d_k key/query/value size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.kernels import explicit_attention
from qkv.attention.masks import causal_mask

from qkv.book.facts import BOOK_D_OUT, BOOK_INPUTS, BOOK_QUERY_POSITION, BOOK_SEED, BOOK_TOKENS  # noqa: E402, F401


@dataclass(frozen=True)
class Walkthrough:
    tokens: tuple[str, ...]
    query_position: int  # counted from 1, as the book writes x(2)
    causal: bool
    inputs: Tensor  # (T, d_in)
    W_query: Tensor  # (d_in, d_out)
    W_key: Tensor  # (d_in, d_out)
    W_value: Tensor  # (d_in, d_out)
    query: Tensor  # (d_out,)
    keys: Tensor  # (T, d_out)
    values: Tensor  # (T, d_out)
    scores: Tensor  # (T,) one dot product per key
    scaled_scores: Tensor  # (T,) scores / sqrt(d_k), -inf where masked
    visible: Tensor  # (T,) bool: which keys the query may see
    weights: Tensor  # (T,) softmax of the scaled scores, sums to 1
    context: Tensor  # (d_out,) weights @ values

    @property
    def query_token(self) -> str:
        return self.tokens[self.query_position - 1]

    def to_json(self) -> dict[str, object]:
        """Plain lists of floats, for --json and for other tools."""

        def plain(t: Tensor) -> object:
            """Nested lists of floats at float32's precision (0.43, not 0.4300000071525574);
            a masked score (-inf, which JSON cannot hold) becomes null."""
            if t.dim() == 0:
                value = float(t)
                return None if math.isinf(value) else float(f"{value:.7g}")
            return [plain(row) for row in t]

        return {
            "tokens": list(self.tokens),
            "query_position": self.query_position,
            "query_token": self.query_token,
            "causal": self.causal,
            "d_in": self.inputs.shape[1],
            "d_out": self.keys.shape[1],
            "inputs": plain(self.inputs),
            "W_query": plain(self.W_query),
            "W_key": plain(self.W_key),
            "W_value": plain(self.W_value),
            "query": plain(self.query),
            "keys": plain(self.keys),
            "values": plain(self.values),
            "scores": plain(self.scores),
            "scaled_scores": plain(self.scaled_scores),
            "visible": self.visible.tolist(),
            "weights": plain(self.weights),
            "context": plain(self.context),
        }


def book_inputs() -> Tensor:
    """The book's 3-d embeddings of "Your journey starts with one step", (6, 3)."""
    return torch.tensor(BOOK_INPUTS)


def run_walkthrough(
    inputs: Tensor | None = None,
    tokens: tuple[str, ...] = BOOK_TOKENS,
    *,
    query_position: int = BOOK_QUERY_POSITION,
    d_out: int = BOOK_D_OUT,
    seed: int = BOOK_SEED,
    causal: bool = False,
) -> Walkthrough:
    """Every step of attention for the query at `query_position` (counted from 1)."""
    inputs = book_inputs() if inputs is None else inputs
    if inputs.dim() != 2:
        raise ValueError(f"inputs must be (tokens, d_in), got shape {tuple(inputs.shape)}")
    num_tokens, d_in = inputs.shape
    if len(tokens) != num_tokens:
        raise ValueError(f"got {len(tokens)} token names for {num_tokens} input rows")
    if not 1 <= query_position <= num_tokens:
        raise ValueError(
            f"query position must be between 1 and {num_tokens} (counted from 1, as the book "
            f"writes x(2)), got {query_position}"
        )
    if d_out < 1:
        raise ValueError(f"d_out must be at least 1, got {d_out}")

    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    W_query = torch.rand(d_in, d_out)
    W_key = torch.rand(d_in, d_out)
    W_value = torch.rand(d_in, d_out)
    torch.set_rng_state(generator_state)  # leave the caller's global RNG as it was

    q_index = query_position - 1
    keys = inputs @ W_key  # (T, d_out)
    values = inputs @ W_value  # (T, d_out)
    query = inputs[q_index] @ W_query  # (d_out,)
    scores = keys @ query  # (T,): the dot product of the query with each key
    scaled_scores = scores / math.sqrt(d_out)
    if causal:
        visible = causal_mask(num_tokens)[q_index]  # (T,): keys 0..q
    else:
        visible = torch.ones(num_tokens, dtype=torch.bool)
    scaled_scores = scaled_scores.masked_fill(~visible, -torch.inf)
    weights = torch.softmax(scaled_scores, dim=-1)  # (T,)
    context = weights @ values  # (d_out,)

    # The same numbers from the library's kernel: the walkthrough shows what qkv computes.
    core_context, core_weights = explicit_attention(
        query.unsqueeze(0), keys, values, mask=visible.unsqueeze(0)
    )
    # torch.allclose with assert_close's float32 tolerances: torch.testing imports
    # torch.distributed on first use (half a second before the first number is printed).
    if not (torch.allclose(core_context[0], context, rtol=1.3e-6, atol=1e-5)
            and torch.allclose(core_weights[0], weights, rtol=1.3e-6, atol=1e-5)):
        raise AssertionError("the walkthrough and qkv's attention kernel disagree")

    return Walkthrough(
        tokens=tuple(tokens),
        query_position=query_position,
        causal=causal,
        inputs=inputs,
        W_query=W_query,
        W_key=W_key,
        W_value=W_value,
        query=query,
        keys=keys,
        values=values,
        scores=scores,
        scaled_scores=scaled_scores,
        visible=visible,
        weights=weights,
        context=context,
    )
