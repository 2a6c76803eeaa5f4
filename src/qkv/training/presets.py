"""Named training presets: a model shape plus the training settings that suit it.

`tiny` trains on "The Verdict" in well under two minutes on two CPU cores; `small` is a
few times larger; `book-124m` is the book's GPT_CONFIG_124M with the book's chapter-5
optimiser settings (AdamW, lr 4e-4, weight decay 0.1, batch 2, 10 epochs, an evaluation
every 5 steps). The model's vocabulary is the preset's, grown to fit the tokenizer when
a larger one is given with --tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qkv.models.gpt2_config import GPT_CONFIG_124M, GPTConfig


@dataclass(frozen=True)
class TrainPreset:
    """Defaults for one named run; every field can be overridden from the command line."""

    name: str
    model: GPTConfig
    batch_size: int
    epochs: int
    lr: float
    weight_decay: float
    warmup_steps: int
    eval_every: int
    save_every: int
    eval_windows: int  # windows of each split used for the train/validation loss

    @property
    def tokenizer_vocab_size(self) -> int:
        """Target size of the byte-level BPE trained on the data."""
        return self.model.vocab_size


DEFAULT_PRESET = "tiny"

PRESETS: dict[str, TrainPreset] = {
    "tiny": TrainPreset(
        name="tiny",
        model=GPTConfig(
            vocab_size=512, context_length=64, emb_dim=96, n_heads=4, n_layers=3,
            drop_rate=0.2, qkv_bias=False,
        ),
        batch_size=8, epochs=16, lr=2e-3, weight_decay=0.1, warmup_steps=10,
        eval_every=20, save_every=50, eval_windows=64,
    ),
    "small": TrainPreset(
        name="small",
        model=GPTConfig(
            vocab_size=2048, context_length=128, emb_dim=256, n_heads=8, n_layers=6,
            drop_rate=0.1, qkv_bias=False,
        ),
        batch_size=16, epochs=10, lr=6e-4, weight_decay=0.1, warmup_steps=20,
        eval_every=25, save_every=100, eval_windows=128,
    ),
    "book-124m": TrainPreset(
        name="book-124m",
        model=replace(GPT_CONFIG_124M),
        batch_size=2, epochs=10, lr=4e-4, weight_decay=0.1, warmup_steps=0,
        eval_every=5, save_every=50, eval_windows=10,
    ),
}
