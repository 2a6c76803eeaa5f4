"""qkv.generation.sampling.choose_rows: every row of a step chosen in one pass, each row what
the one-row reference gives it alone (`sample(adjust_logits(masked logits))` with its own
generator), token for token, whatever the other rows are."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qkv.generation.sampling import RowSampling, Sampling, adjust_logits, choose_rows, sample

V = 96


def reference(logits: torch.Tensor, row: RowSampling) -> int:
    """One row alone: the grammar's mask, then bias and penalties, then sampling."""
    masked = logits if row.forbidden is None else logits.masked_fill(row.forbidden, -torch.inf)
    s = row.sampling
    scores = adjust_logits(masked, s, row.counts)
    return int(sample(scores, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=row.generator)[0])


samplings = st.builds(
    Sampling,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([None, 1, 5, 40, V + 3]),
    top_p=st.sampled_from([None, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**20),
    logit_bias=st.sampled_from([(), ((3, 100.0),), ((7, -100.0), (8, 2.5))]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, -1.0]),
)


def make_row(sampling: Sampling, draw_seed: int, *, masked: bool) -> RowSampling:
    g = torch.Generator().manual_seed(draw_seed)
    counts = torch.randint(0, 3, (1, V), generator=g).float() if sampling.penalised else None
    forbidden = torch.rand(V, generator=g) < 0.5 if masked else None
    if forbidden is not None:
        forbidden[int(torch.randint(0, V, (1,), generator=g))] = False  # one token stays allowed
    return RowSampling(sampling, None if sampling.greedy else sampling.generator(), counts, forbidden)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(samplings, st.booleans()), min_size=1, max_size=6), st.integers(0, 1000))
def test_each_row_is_what_it_would_be_alone(rows: list[tuple[Sampling, bool]], seed: int) -> None:
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3  # (b, V)
    batched = [make_row(s, seed + i, masked=m) for i, (s, m) in enumerate(rows)]
    alone = [make_row(s, seed + i, masked=m) for i, (s, m) in enumerate(rows)]  # the same, fresh generators
    for _ in range(3):  # a few steps: the generators advance alike
        got = choose_rows(logits, batched).tolist()
        want = [reference(logits[i:i + 1], row) for i, row in enumerate(alone)]
        assert got == want
        logits = logits.roll(1, dims=-1)


def test_the_models_logits_are_not_written() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    forbidden = torch.zeros(V, dtype=torch.bool)
    forbidden[:50] = True
    rows = [RowSampling(Sampling(logit_bias=((1, 5.0),)), forbidden=forbidden),
            RowSampling(Sampling(temperature=1.0, seed=1), Sampling(seed=1).generator())]
    choose_rows(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("others", [0, 1, 5])
def test_a_seeded_row_draws_the_same_beside_any_rows(others: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1 + others, V)
    mine = Sampling(temperature=0.9, top_p=0.8, seed=42)
    neighbours = [RowSampling(Sampling(temperature=1.0, top_k=3, seed=i), Sampling(seed=i).generator())
                  for i in range(others)]
    row = RowSampling(mine, mine.generator())
    got = [int(choose_rows(logits, [row, *neighbours])[0]) for _ in range(20)]
    alone_row = RowSampling(mine, mine.generator())
    alone = [int(choose_rows(logits[:1], [alone_row])[0]) for _ in range(20)]
    assert got == alone and len(set(got)) > 1  # it really samples
