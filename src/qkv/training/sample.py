"""A greedy continuation of a fixed prompt, shown at every evaluation.

Watching the same prompt continue ("Every effort moves you", the book's) is how the
book shows a model learning. Greedy decoding (qkv.generation with temperature 0) makes
the text a function of the weights alone, and generation draws from its own generator,
so a sample never disturbs the training RNG (resumed runs stay exact).

Shape legend: B batch (1 here), T tokens.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from qkv.generation import generate
from qkv.models.gpt2 import GPT2Decoder


def greedy_continuation(
    model: GPT2Decoder, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int,
    device: torch.device, eos_token_id: int | None = None,
) -> str:
    """The prompt's continuation (new text only), as much as the context length allows."""
    context = model.context_length
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids[-(context - 1) :]
    new_tokens = min(max_new_tokens, context - len(ids))
    prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    out = generate(model, prompt_ids, new_tokens, temperature=0.0, seed=0, eos_token_id=eos_token_id)
    return tokenizer.decode(out[0, len(ids) :].tolist())
