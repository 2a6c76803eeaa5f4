"""A greedy continuation of a fixed prompt, shown at every evaluation.

Watching the same prompt continue ("Every effort moves you", the book's) is how the
book shows a model learning; greedy decoding makes the text a function of the weights
alone, so it does not disturb the training RNG.

Shape legend: B batch (1 here), T tokens, V vocabulary.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from torch import nn


@torch.no_grad()
def greedy_continuation(
    model: nn.Module, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int,
    context_length: int, device: torch.device,
) -> str:
    """The prompt's continuation (new text only), picking the likeliest token each step."""
    was_training = model.training
    model.eval()
    try:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        tokens = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -context_length:])  # (1, T, V)
            next_id = logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
            tokens = torch.cat([tokens, next_id], dim=1)
        return tokenizer.decode(tokens[0, len(ids):].tolist())
    finally:
        model.train(was_training)
