"""Choosing the next token from logits: logit bias, presence and frequency penalties,
then greedy, temperature, top-k and top-p.

`Sampling` holds the choices, checked once when it is made; `adjust_logits` applies the
bias and penalties (OpenAI's definitions) to the model's logits, `sample` the rest, and
`choose` does both. Sampling draws from its own torch.Generator (`Sampling.generator`),
never from the global RNG, so a seed repeats a generation exactly.

Shape legend: B batch, V vocabulary.
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


def choose(logits: Tensor, sampling: Sampling, generator: torch.Generator | None,
           counts: Tensor | None = None) -> Tensor:
    """`adjust_logits`, then `sample` with the choices of `sampling`: (B, V) -> (B,)."""
    return sample(adjust_logits(logits, sampling, counts), temperature=sampling.temperature,
                  top_k=sampling.top_k, top_p=sampling.top_p, generator=generator)
