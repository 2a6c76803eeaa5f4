"""Choosing the next token from logits: logit bias, presence and frequency penalties,
then greedy, temperature, top-k and top-p.

`Sampling` holds the choices, checked once when it is made; `adjust_logits` applies the
bias and penalties (OpenAI's definitions) to the model's logits, `sample` the rest; the
decode loop chooses every row of a step at once with `choose_rows`, which computes for each
row what those two give it alone (a test says so). Sampling draws from its own torch.Generator (`Sampling.generator`),
never from the global RNG, so a seed repeats a generation exactly.

Shape legend: B batch, b rows of a step, s of them sampled, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import QkvError

# Below this a temperature divides logits into overflow (inf - inf = NaN): it is greedy in
# all but name, so it is refused rather than silently made greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 is greedy (argmax); top_k keeps the k
    most likely tokens; top_p keeps the smallest set of most likely tokens whose
    probabilities add up to at least p; seed makes sampling repeatable."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    # (token id, bias) pairs added to the logits before anything else, greedy included:
    # +100 all but forces a token, -100 all but forbids it (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Over the tokens generated so far, c[j] times token j: logit[j] -= c[j] * frequency
    # + (c[j] > 0) * presence (OpenAI's presence_penalty and frequency_penalty).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, int | float) or not math.isfinite(t) or t < 0.0:
            raise QkvError(f"temperature must be >= 0 (0 = greedy) and finite, got {t}")
        if 0.0 < t < MIN_TEMPERATURE:
            raise QkvError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise QkvError(f"top_k must be at least 1, got {self.top_k}")
        if self.top_p is not None and not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise QkvError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise QkvError(f"seed must be an integer in [0, 2**63), got {self.seed}")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and math.isfinite(bias) and -100 <= bias <= 100):
                raise QkvError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and -2.0 <= value <= 2.0):
                raise QkvError(f"{name} must be between -2 and 2, got {value}")

    @property
    def penalised(self) -> bool:
        """Whether choices depend on the tokens generated so far (the penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator: seeded with `seed`, or from the system's entropy."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def sample(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens (B,) from last-position logits (B, V). Temperature 0 is greedy (argmax).

    top_k keeps the k most likely tokens; top_p keeps the smallest set of most likely
    tokens whose probabilities add up to at least p (the most likely one always stays).
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        sorted_scores = sorted_scores.masked_fill(mass_before >= top_p, -torch.inf)
        scores = torch.full_like(scores, -torch.inf).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


def adjust_logits(logits: Tensor, sampling: Sampling, counts: Tensor | None = None) -> Tensor:
    """The logits (B, V) with `sampling`'s logit bias added, then its penalties subtracted
    for `counts` (B, V), how often each token was generated so far; unchanged without them."""
    if not sampling.logit_bias and (counts is None or not sampling.penalised):
        return logits
    scores = logits.float().clone()  # (B, V)
    if sampling.logit_bias:
        ids = torch.tensor([token for token, _ in sampling.logit_bias], device=scores.device)
        bias = torch.tensor([b for _, b in sampling.logit_bias], device=scores.device)
        keep = ids < scores.shape[-1]
        scores[:, ids[keep]] += bias[keep]
    if counts is not None and sampling.penalised:
        counts = counts.to(scores.dtype)
        scores -= counts * sampling.frequency_penalty + (counts > 0).to(scores.dtype) * sampling.presence_penalty
    return scores


@dataclass
class RowSampling:
    """One row of `choose_rows`: its choices, its own generator (None when greedy), how often
    it generated each token so far (V,) for the penalties, and the tokens its grammar
    forbids now (V,) bool, if any."""

    sampling: Sampling
    generator: torch.Generator | None = None
    counts: Tensor | None = None
    forbidden: Tensor | None = None


def choose_rows(logits: Tensor, rows: list[RowSampling]) -> Tensor:
    """Next tokens (b,) for logits (b, V), row i chosen as `rows[i]` says, in one pass.

    Row i's token is what `sample(adjust_logits(masked row i, ...))` gives it alone, with its
    own generator: grammar masks, bias and penalties are written into one copy of the logits
    (only when some row has them), the greedy rows take one argmax, the sampled rows are
    divided by their temperatures, cut by their top-k and top-p (only the rows that ask) and
    turned into probabilities together, and each draws from its own generator, so a seeded
    row draws the same whatever else is in the batch.
    """
    b, vocab = logits.shape
    if any(r.forbidden is not None or r.sampling.logit_bias or (r.counts is not None and r.sampling.penalised)
           for r in rows):
        logits = logits.float().clone()  # (b, V): written in place below, the model's logits kept
        for i, row in enumerate(rows):
            if row.forbidden is not None:
                logits[i].masked_fill_(row.forbidden, -torch.inf)
            if row.sampling.logit_bias or (row.counts is not None and row.sampling.penalised):
                logits[i:i + 1] = adjust_logits(logits[i:i + 1], row.sampling, row.counts)
    if all(row.sampling.greedy for row in rows):
        return logits.argmax(dim=-1)
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)  # (b,)
    greedy = [i for i, row in enumerate(rows) if row.sampling.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.sampling.greedy]
    if not drawn:
        return tokens
    picked = [rows[i].sampling for i in drawn]
    temperatures = torch.tensor([[s.temperature] for s in picked], dtype=torch.float32, device=logits.device)
    scores = logits[drawn].float() / temperatures  # (s, V)
    cut_k = [j for j, s in enumerate(picked) if s.top_k is not None and s.top_k < vocab]
    if cut_k:
        ks = torch.tensor([picked[j].top_k - 1 for j in cut_k], device=logits.device)[:, None]  # (k, 1)
        part = scores[cut_k]
        kth = torch.topk(part, int(ks.max()) + 1, dim=-1).values.gather(1, ks)  # (k, 1) each row's k-th best
        scores[cut_k] = part.masked_fill(part < kth, -torch.inf)
    cut_p = [j for j, s in enumerate(picked) if s.top_p is not None and s.top_p < 1.0]
    if cut_p:
        ps = torch.tensor([[picked[j].top_p] for j in cut_p], dtype=torch.float32, device=logits.device)  # (p, 1)
        sorted_scores, order = scores[cut_p].sort(dim=-1, descending=True)  # (p, V)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        sorted_scores = sorted_scores.masked_fill(mass_before >= ps, -torch.inf)
        scores[cut_p] = torch.full_like(sorted_scores, -torch.inf).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)  # (s, V)
    for j, i in enumerate(drawn):  # each row's own generator: one draw each
        tokens[i] = torch.multinomial(probs[j:j + 1], 1, generator=rows[i].generator)[0, 0]
    return tokens
