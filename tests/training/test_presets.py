"""Presets become the models they name; options override them; bad values are QkvErrors."""

from __future__ import annotations

import pytest

from qkv.errors import QkvError
from qkv.models.gpt2 import GPT_CONFIG_124M
from qkv.training import TrainSettings
from qkv.training.settings import model_config


def test_presets_build_the_models_they_name() -> None:
    book = TrainSettings.from_preset("book-124m", data="d", out="o")
    assert model_config(book, 50257) == GPT_CONFIG_124M  # the book's config, unchanged
    assert (book.lr, book.weight_decay, book.batch_size, book.epochs) == (4e-4, 0.1, 2, 10)  # chapter 5
    tiny = TrainSettings.from_preset("tiny", data="d", out="o", context_length=32, dropout=0.0)
    cfg = model_config(tiny, 300)
    assert (cfg.context_length, cfg.drop_rate, cfg.vocab_size) == (32, 0.0, 512)
    assert model_config(tiny, 50257).vocab_size == 50257  # grown to fit a larger tokenizer


def test_overrides_and_their_checks() -> None:
    s = TrainSettings.from_preset("tiny", data="d", out="o", max_steps=5, context_length=32)
    assert (s.max_steps, s.epochs, s.stride) == (5, None, 32)  # stride follows the window, as in the book
    assert TrainSettings.from_dict(s.to_dict()) == s
    with pytest.raises(QkvError, match="at least 1"):
        TrainSettings.from_preset("tiny", data="d", out="o", batch_size=0)
    with pytest.raises(QkvError, match="unknown preset"):
        TrainSettings.from_preset("huge", data="d", out="o")


def test_width_depth_and_heads_can_be_overridden() -> None:
    s = TrainSettings.from_preset("tiny", data="d", out="o", emb_dim=32, n_layers=1, n_heads=2)
    cfg = model_config(s, 300)
    assert (cfg.emb_dim, cfg.n_layers, cfg.n_heads) == (32, 1, 2)
    with pytest.raises(QkvError, match="divisible"):
        model_config(TrainSettings.from_preset("tiny", data="d", out="o", emb_dim=30, n_heads=4), 300)
    with pytest.raises(QkvError, match="at least 1"):
        TrainSettings.from_preset("tiny", data="d", out="o", n_layers=0)


def test_the_book_preset_is_the_books_chapter5_run() -> None:
    from dataclasses import replace

    from qkv.training import PRESETS

    s = TrainSettings.from_preset("book", data="d", out="o")
    assert model_config(s, 50257) == replace(GPT_CONFIG_124M, context_length=256)
    assert (s.lr, s.weight_decay, s.batch_size, s.epochs, s.eval_every, s.stride) == (4e-4, 0.1, 2, 10, 5, 256)
    assert (s.grad_clip, s.min_lr_ratio, s.warmup_steps, s.sample_tokens) == (None, 1.0, 0, 50)  # constant lr, no clipping
    assert s.eval_windows // s.batch_size == 5  # the book's eval_iter
    assert PRESETS["book"].loop == "book" and PRESETS["book-124m"].loop == "qkv"
    assert PRESETS["book"].tokenizer == PRESETS["book-124m"].tokenizer == "gpt2"
