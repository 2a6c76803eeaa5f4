"""Presets become the models they name; options override them; bad values are QkvErrors."""

from __future__ import annotations

import pytest

from qkv.errors import QkvError
from qkv.models.gpt2 import GPT_CONFIG_124M
from qkv.training import TrainSettings
from qkv.training.loop import model_config


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
