"""Sliding-window perplexity: the windows score every token once with the promised history,
and the numbers equal transformers' loss computed with Hugging Face's strided method
(labels -100 outside each window's new tokens), on SmolLM2 and on a tiny random Llama
through the CLI. Bad input: one line, exit code 2."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qkv.cli.main import main
from qkv.errors import QkvError
from qkv.eval.perplexity import perplexity, windows

smollm2 = pytest.mark.xdist_group("smollm2")
TEXT = (
    "I had always thought him a cheap genius, though a good fellow enough. "
    "It was no great surprise to me to hear that, in the height of his glory, he had dropped "
    "his painting, married a rich widow, and established himself in a villa on the Riviera. "
) * 3


def hf_strided_perplexity(model, ids: torch.Tensor, max_length: int, stride: int) -> float:
    """Hugging Face's documented method, with transformers computing the loss."""
    n = ids.shape[1]
    nll_sum, scored, prev_end = 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.inference_mode():
            loss = model(input_ids, labels=labels).loss.item()
        count = int((labels[:, 1:] != -100).sum())  # the loss shifts labels by one
        nll_sum += loss * count
        scored += count
        prev_end = end
        if end == n:
            break
    return math.exp(nll_sum / scored)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 300), context=st.integers(2, 64), data=st.data())
def test_windows_score_every_token_once_with_history(n: int, context: int, data) -> None:
    stride = data.draw(st.integers(1, context - 1))
    scored: list[int] = []
    for begin, end, first in windows(n, context, stride):
        assert end - begin <= context and begin < first <= end
        for p in range(first, end):
            assert p - begin >= min(p, context - stride)  # tokens of history it sees
        scored.extend(range(first, end))
    assert scored == list(range(1, n))


def test_bad_window_sizes() -> None:
    for stride in (0, 8, 9):
        with pytest.raises(QkvError, match="stride must be between 1 and the context length - 1"):
            list(windows(10, 8, stride))
    with pytest.raises(QkvError, match="at least 2"):
        list(windows(10, 1, 1))


@smollm2
@pytest.mark.slow
def test_smollm2_perplexity_equals_transformers(smollm2_model, hf_smollm2_model) -> None:
    model, tokenizer = smollm2_model
    ids = torch.tensor(tokenizer.encode(TEXT).ids)[:160]
    ours = perplexity(model, ids, context_length=64, stride=48)
    reference = hf_strided_perplexity(hf_smollm2_model, ids.unsqueeze(0), 64, 48)
    assert ours.tokens == 159 and ours.windows == 3
    assert ours.perplexity == pytest.approx(reference, rel=1e-4)
    # More context per token helps a real model: barely overlapping windows are worse.
    assert perplexity(model, ids, context_length=64, stride=63).perplexity > ours.perplexity


# ----------------------------------------------------------------------------- CLI, tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, object]:
    """A 2-layer random Llama saved by transformers, with a tokenizer.json from `tokenizers`."""
    import transformers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([TEXT], trainer)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, model


def test_cli_prints_the_perplexity_transformers_computes(tiny, tmp_path: Path, capsys) -> None:
    folder, hf_model = tiny
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    code = main(["perplexity", "--model", str(folder), "--data", str(data), "--context-length", "32", "--stride", "24"])
    out, err = capsys.readouterr()
    assert code == 0, err
    printed = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
    ids = torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids])
    assert printed == pytest.approx(hf_strided_perplexity(hf_model, ids, 32, 24), abs=1e-3)
    assert f"on {ids.shape[1] - 1} tokens" in out


@pytest.mark.parametrize("options, window, stride", [([], 128, 64), (["--stride", "100"], 128, 100)])
def test_cli_defaults_to_the_models_context(tiny, tmp_path: Path, capsys, options, window, stride) -> None:
    """A model with a 128-token context is scored in 128-token windows (the default caps at
    1024), stride half of that unless given; the number is transformers' on those windows."""
    folder, hf_model = tiny
    data = tmp_path / "text.txt"
    data.write_text(TEXT * 3, encoding="utf-8")
    code = main(["perplexity", "--model", str(folder), "--data", str(data), *options])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"windows of {window} tokens, stride {stride}" in out
    ids = torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT * 3).ids])
    assert ids.shape[1] > window  # more than one window
    printed = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
    assert printed == pytest.approx(hf_strided_perplexity(hf_model, ids, window, stride), abs=1e-3)


@pytest.mark.parametrize(
    "make, options, message",
    [
        (None, [], "does not exist"),
        (b"\xff\xfe not utf-8 \xc3", [], "not UTF-8"),
        (b"  \n\n ", [], "no text to score"),
        (TEXT.encode(), ["--context-length", "16", "--stride", "20"], "stride must be between 1"),
        (TEXT.encode(), ["--context-length", "512"], "exceeds the model's context length"),
    ],
)
def test_cli_bad_input_is_one_line(tiny, tmp_path: Path, capsys, make, options, message) -> None:
    folder, _ = tiny
    data = tmp_path / "data.txt"
    if make is not None:
        data.write_bytes(make)
    code = main(["perplexity", "--model", str(folder), "--data", str(data), *options])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_cli_missing_model(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data.txt"
    data.write_text(TEXT, encoding="utf-8")
    code = main(["perplexity", "--model", str(tmp_path / "nowhere"), "--data", str(data)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
