"""The evaluation sample is the greedy continuation a plain argmax loop produces, and
taking it leaves the training RNG untouched."""

from __future__ import annotations

import torch

from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.training.sample import greedy_continuation
from qkv.training.tokenizer import train_bpe


def test_sample_is_the_argmax_loop_and_keeps_the_rng(verdict_text: str) -> None:
    tokenizer = train_bpe(verdict_text[:5000], 300)
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=300, context_length=24, emb_dim=32, n_heads=4, n_layers=2))
    prompt = "Every effort moves you"
    ids = tokenizer.encode(prompt).ids
    tokens = torch.tensor([ids])
    model.eval()
    with torch.no_grad():
        while tokens.shape[1] < 24:  # the whole context: the sample fills it
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train()
    rng = torch.get_rng_state()
    text = greedy_continuation(model, tokenizer, prompt, max_new_tokens=100, device=torch.device("cpu"))
    assert text == tokenizer.decode(tokens[0, len(ids):].tolist())
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training  # restored for the next training step
