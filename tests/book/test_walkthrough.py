"""The walkthrough against the book's printed figures (chapter 3.4.1) and the functional core."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import explicit_attention
from qkv.book.walkthrough import book_inputs, run_walkthrough

# Published in "Build a Large Language Model (From Scratch)", section 3.4.1.
BOOK_QUERY_2 = [0.4306, 1.4551]
BOOK_SCORES_2 = [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440]
BOOK_WEIGHTS_2 = [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820]
BOOK_CONTEXT_2 = [0.3061, 0.8210]


def test_reproduces_the_books_journey_walkthrough() -> None:
    w = run_walkthrough()
    assert w.query_token == "journey"
    assert w.keys.shape == (6, 2)
    torch.testing.assert_close(w.query, torch.tensor(BOOK_QUERY_2), atol=5e-5, rtol=0)
    torch.testing.assert_close(w.scores, torch.tensor(BOOK_SCORES_2), atol=5e-5, rtol=0)
    torch.testing.assert_close(w.weights, torch.tensor(BOOK_WEIGHTS_2), atol=5e-5, rtol=0)
    torch.testing.assert_close(w.context, torch.tensor(BOOK_CONTEXT_2), atol=5e-5, rtol=0)


def test_matches_the_books_v1_class_row_for_every_query() -> None:
    """SelfAttention_v1 with the same seed computes the same context for every token."""
    from qkv.book import SelfAttention_v1

    torch.manual_seed(123)
    module = SelfAttention_v1(3, 2)
    expected = module(book_inputs())
    for position in range(1, 7):
        w = run_walkthrough(query_position=position)
        torch.testing.assert_close(w.context, expected[position - 1].detach())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    d_out=st.integers(1, 6),
    position=st.integers(1, 6),
    causal=st.booleans(),
)
def test_steps_are_consistent(seed: int, d_out: int, position: int, causal: bool) -> None:
    w = run_walkthrough(query_position=position, d_out=d_out, seed=seed, causal=causal)
    assert torch.all(w.weights >= 0)
    torch.testing.assert_close(w.weights.sum(), torch.tensor(1.0))
    if causal:
        assert w.visible.tolist() == [i < position for i in range(6)]
        assert torch.all(w.weights[position:] == 0)
    reference = torch.nn.functional.scaled_dot_product_attention(
        w.query[None, None], w.keys[None], w.values[None], attn_mask=w.visible[None, None]
    )[0, 0]
    torch.testing.assert_close(w.context, reference, atol=1e-6, rtol=1e-5)
    ctx, _ = explicit_attention(w.query[None], w.keys, w.values, mask=w.visible[None])
    torch.testing.assert_close(ctx[0], w.context)


def test_leaves_the_global_rng_untouched() -> None:
    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    run_walkthrough(seed=99)
    torch.testing.assert_close(torch.rand(3), before)
