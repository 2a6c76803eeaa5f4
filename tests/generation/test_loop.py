"""Generation: left-padded batches, sampling invariants, seeds, end tokens, argument checks.

Parity with transformers' generate lives in tests/models/test_against_hf.py; here the
references are each prompt generated alone, the full uncached forward pass, and the
softmax distribution itself.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.attention.caches.kv_cache import KVCache
from qkv.attention.rope import Llama3RopeScaling
from qkv.errors import QkvError
from qkv.generation import sample, stream
from qkv.models.decoder import CausalDecoder
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.qwen import Qwen3Config

VOCAB = 97


def spread(model: CausalDecoder, seed: int = 0) -> CausalDecoder:
    """Large random weights: logits far from flat, so greedy choices are not near-ties."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()


def llama() -> LlamaForCausalLM:
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rope_scaling=scaling,
    )
    return spread(LlamaForCausalLM(cfg))


def gpt() -> GPT2Decoder:
    return spread(GPT2Decoder(GPTConfig(vocab_size=VOCAB, context_length=64, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)))


MODELS = {"qwen3-llama3-rope": llama, "gpt2": gpt}


def prompts(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("make", list(MODELS.values()), ids=list(MODELS))
def test_left_padded_batch_equals_each_prompt_alone(make, use_cache: bool) -> None:
    model = make()
    rows = prompts(3, 9, 6)
    ids, mask = left_pad(rows)
    batch = qkv.generate(model, ids, 20, use_cache=use_cache, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = qkv.generate(model, row[None], 20, use_cache=use_cache)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(row):]), f"row {i}"


def test_padded_batch_logits_equal_alone() -> None:
    """The real tokens of a padded row see exactly what they would see alone."""
    model = llama()
    rows = prompts(4, 10)
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = model(ids, positions=positions, mask=mask)
        alone = model(rows[0][None])
    torch.testing.assert_close(batch[0, -4:], alone[0], rtol=0, atol=1e-5)


def test_decode_steps_have_static_shapes_and_tensor_positions() -> None:
    """Each decode step is one token with its position as a (1,) tensor and no mask: the
    same shapes at every length (what one compiled graph for every length needs)."""
    model = llama()
    calls: list[tuple[int, list[int], tuple[int, ...], object]] = []

    def record(module, args, kwargs):
        pos = kwargs.get("positions")
        calls.append((args[0].shape[1], pos.reshape(-1).tolist(), tuple(pos.shape), kwargs.get("mask")))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    qkv.generate(model, prompts(5)[0][None], 6)
    handle.remove()
    assert calls[0][:2] == (5, [0, 1, 2, 3, 4]) and len(calls) == 6
    assert [c[1] for c in calls[1:]] == [[5], [6], [7], [8], [9]]
    # (1,) in a whole-batch session, (1, 1) (one per row) in a session of slots: one shape either way
    assert len({shape for _, _, shape, _ in calls[1:]}) == 1
    assert all(t == 1 and shape in ((1,), (1, 1)) and mask is None for t, _, shape, mask in calls[1:])


def test_generate_restores_the_model() -> None:
    model = gpt().train()
    qkv.generate(model, prompts(4)[0][None], 3)
    assert model.training and not any(isinstance(m, KVCache) for m in model.modules())


def test_stream_yields_what_generate_returns() -> None:
    model = llama()
    x = prompts(5)[0][None]
    streamed = torch.stack(list(stream(model, x, 12, temperature=0.9, top_p=0.8, seed=3)), dim=1)
    assert torch.equal(qkv.generate(model, x, 12, temperature=0.9, top_p=0.8, seed=3)[:, 5:], streamed)


def test_end_token_stops_every_row_and_fills_finished_rows() -> None:
    model = gpt()
    x = torch.stack(prompts(5, 5))
    free = qkv.generate(model, x, 30)  # (2, 35), no end token
    eos = int(free[0, 5])  # row 0's first new token becomes the end token
    stopped = qkv.generate(model, x, 30, eos_token_id=[eos, VOCAB + 1])
    ends = []
    for row in free[:, 5:]:
        hits = (row == eos).nonzero()
        ends.append(int(hits[0]) + 1 if len(hits) else 30)  # new tokens up to the end token
    assert stopped.shape == (2, 5 + max(ends))
    for r, end in enumerate(ends):
        assert torch.equal(stopped[r, : 5 + end], free[r, : 5 + end])
        assert bool((stopped[r, 5 + end :] == eos).all())


# ---- sampling -------------------------------------------------------------------------


def test_temperature_zero_is_argmax_and_top_k_one_is_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits), logits.argmax(-1))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits, temperature=1.5, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(sample(logits, temperature=1.5, top_p=1e-6, generator=g), logits.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 20), p=st.floats(0.05, 1.0), seed=st.integers(0, 2**31 - 1))
def test_sampled_tokens_lie_in_the_top_k_and_top_p_sets(k: int, p: float, seed: int) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed))
    token = sample(logits, temperature=1.0, top_k=k, top_p=p, generator=torch.Generator().manual_seed(seed))
    for row, t in zip(logits, token, strict=True):
        order = row.argsort(descending=True)
        rank = int((order == t).nonzero())
        probs = row.softmax(-1)[order]
        mass_before = float(probs[:rank].sum())
        assert rank < k and (rank == 0 or mass_before < p)


def test_sampling_follows_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, temperature=2.0, generator=g) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=5).double() / 4000
    torch.testing.assert_close(freq, (logits[0].double() / 2.0).softmax(-1), rtol=0, atol=0.03)


def test_seed_repeats_and_global_rng_is_untouched() -> None:
    model = llama()
    x = prompts(4)[0][None]
    state = torch.get_rng_state()
    a = qkv.generate(model, x, 15, temperature=1.0, seed=11)
    b = qkv.generate(model, x, 15, temperature=1.0, seed=11)
    c = qkv.generate(model, x, 15, temperature=1.0, seed=12)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---- bad arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be a non-negative integer"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_k": 0}, "top_k must be at least 1"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_raise_qkv_error(kwargs: dict, message: str) -> None:
    args = {"max_new_tokens": 5, **kwargs}
    with pytest.raises(QkvError, match=message):
        qkv.generate(gpt(), prompts(4)[0][None], args.pop("max_new_tokens"), **args)


def test_right_padding_is_refused() -> None:
    model = gpt()
    ids, mask = left_pad(prompts(2, 4))
    with pytest.raises(QkvError, match="left padding"):
        qkv.generate(model, ids, 2, attention_mask=mask.flip(-1))
