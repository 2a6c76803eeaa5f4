"""`qkv train --preset book` against the book's own chapter-5 code (tests/training/book_reference,
copied from rasbt/LLMs-from-scratch under Apache-2.0): the same printed lines, losses, samples."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from qkv.cli.main import main
from qkv.errors import QkvError
from qkv.training import TrainSettings, train

REFERENCE = Path(__file__).parents[1] / "book_reference"
SHAPE = {"emb_dim": 32, "n_layers": 2, "n_heads": 2, "context_length": 32}


@pytest.fixture
def book_code(monkeypatch):
    """The book's modules, with tiktoken's gpt2 encoding made offline from the packaged ranks."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    from qkv.models.hf.gpt2_tokenizer import ranks_path

    encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=load_tiktoken_bpe(str(ranks_path())),
                                 special_tokens={"<|endoftext|>": 50256})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: encoding)
    monkeypatch.syspath_prepend(str(REFERENCE))
    for name in ("previous_chapters", "gpt_train"):
        sys.modules.pop(name, None)
    import gpt_train

    return gpt_train, encoding


def run_the_book(gpt_train, tokenizer, text: str, epochs: int) -> None:
    """The notebook's cells of section 5.2, with the small shape."""
    from previous_chapters import GPTModel, create_dataloader_v1

    cfg = {"vocab_size": 50257, "context_length": SHAPE["context_length"], "emb_dim": SHAPE["emb_dim"],
           "n_heads": SHAPE["n_heads"], "n_layers": SHAPE["n_layers"], "drop_rate": 0.1, "qkv_bias": False}
    split_idx = int(0.90 * len(text))
    torch.manual_seed(123)
    train_loader = create_dataloader_v1(text[:split_idx], batch_size=2, max_length=cfg["context_length"],
                                        stride=cfg["context_length"], drop_last=True, shuffle=True, num_workers=0)
    val_loader = create_dataloader_v1(text[split_idx:], batch_size=2, max_length=cfg["context_length"],
                                      stride=cfg["context_length"], drop_last=False, shuffle=False, num_workers=0)
    torch.manual_seed(123)
    model = GPTModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1)
    gpt_train.train_model_simple(model, train_loader, val_loader, optimizer, torch.device("cpu"),
                                 num_epochs=epochs, eval_freq=5, eval_iter=5,
                                 start_context="Every effort moves you", tokenizer=tokenizer)


def book_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("Ep ", "Every effort"))]


@pytest.mark.slow
def test_prints_what_the_books_code_prints(book_code, verdict_text, tmp_path, capsys):
    gpt_train, encoding = book_code
    text = verdict_text[:5000]
    data = tmp_path / "story.txt"
    data.write_text(text, encoding="utf-8")
    run_the_book(gpt_train, encoding, text, epochs=2)
    theirs = book_lines(capsys.readouterr().out)
    code = main(["train", "--preset", "book", "--data", str(data), "--out", str(tmp_path / "run"), "--epochs", "2",
                 "--threads", str(torch.get_num_threads()), *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]])
    ours = book_lines(capsys.readouterr().out)
    assert code == 0
    assert len(theirs) >= 8 and any(line.startswith("Every effort") for line in theirs)
    assert ours == theirs
    assert re.fullmatch(r"Ep 1 \(Step 000000\): Train loss \d+\.\d{3}, Val loss \d+\.\d{3}", ours[0])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png"):
        assert (tmp_path / "run" / name).is_file()
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()  # no optimizer state is kept


def test_options_the_books_run_cannot_take_are_refused(story_file, tmp_path):
    settings = TrainSettings.from_preset("book", data=str(story_file), out=str(tmp_path / "a"), **SHAPE, max_steps=1)
    assert (settings.grad_clip, settings.min_lr_ratio, settings.sample_tokens) == (None, 1.0, 50)
    train(settings, progress=False)
    record = json.loads((tmp_path / "a" / ".qkv-run.json").read_text())
    assert record["model_config"]["vocab_size"] == 50257 == record["settings"]["vocab_size"]  # GPT-2's, the model's
    assert Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")).get_vocab_size() == 50257
    with pytest.raises(QkvError, match="cannot --resume"):
        train(settings, resume=True)
