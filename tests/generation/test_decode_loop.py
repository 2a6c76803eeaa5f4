"""The decode loop's hand-off point: `step(chosen=...)` sees a step's tokens before the decode
call that follows them, and a row finished there is not decoded; the tokens are the same
as a loop stepped without it (the reference: the same loop on the same prompts)."""

from __future__ import annotations

import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.generation.decode_loop import DecodeLoop, RowRequest, StepToken
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.qwen import Qwen3Config
from qkv.runtime.session import DecodeSession

VOCAB = 61


def model() -> LlamaForCausalLM:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    made = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in made.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)  # logits far from flat: no greedy near-ties
    return made.eval()


def run(decoder: LlamaForCausalLM, chosen=None, log: list[str] | None = None) -> list[list[int]]:
    """Three prompts as rows 0..2 of one session, 6 greedy tokens each (row 1: 3)."""
    got: list[list[int]] = [[], [], []]
    with DecodeSession(decoder, batch_size=3, capacity=64, kind=SlotKVCache, step="modules") as session:
        if log is not None:
            decode = session.decode

            def logged(tokens, rows=None):
                log.append(f"decode {rows}")
                return decode(tokens, rows=rows)
            session.decode = logged  # type: ignore[method-assign]
        loop = DecodeLoop(session)
        for row, ids in enumerate(([3, 5, 7], [11, 2], [4, 4, 9, 1])):
            logits = session.prefill_row(row, torch.tensor(ids))
            loop.start(row, logits, RowRequest(max_tokens=3 if row == 1 else 6))
        while loop.running:
            for choice in loop.step(chosen=None if chosen is None else lambda c: chosen(loop, c)):
                got[choice.row].append(choice.token)
    return got


def test_chosen_runs_before_the_decode_call_and_changes_no_token() -> None:
    decoder = model()
    log: list[str] = []

    def chosen(loop: DecodeLoop, choices: list[StepToken]) -> None:
        log.append("chosen " + " ".join(f"{c.row}:{c.end or '-'}" for c in choices))

    reference = run(decoder)
    assert run(decoder, chosen, log) == reference
    # every step: its tokens first, then one decode of the rows going on (none after the last)
    assert log[:2] == ["chosen 0:- 1:- 2:-", "decode [0, 1, 2]"]
    assert log[4:6] == ["chosen 0:- 1:length 2:-", "decode [0, 2]"]
    assert log[-1] == "chosen 0:length 2:length" and len(log) == 11


def test_a_row_finished_in_chosen_is_not_decoded() -> None:
    decoder = model()
    log: list[str] = []

    def cancel_row_two(loop: DecodeLoop, choices: list[StepToken]) -> None:
        if 2 in loop.running:
            loop.finish(2)  # a closed connection, noticed while the step's tokens went out

    got = run(decoder, cancel_row_two, log)
    assert log[0] == "decode [0, 1]" and len(got[2]) == 1
    assert got[:2] == run(decoder)[:2]  # the others are not touched
