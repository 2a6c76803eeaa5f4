"""Named training presets: a model shape plus the training settings that suit it.

`tiny` trains on "The Verdict" in well under two minutes on two CPU cores; `small` is a
few times larger. `book` is the book's chapter-5 run itself (qkv.training.book.run: the
book's GPTModel with GPT_CONFIG_124M at context 256, GPT-2's tokenizer, the book's loader
order, AdamW lr 4e-4 and weight decay 0.1 on every parameter, a constant rate, no
clipping, an evaluation every 5 steps on 5 batches, ten epochs). `book-124m` is the same
model and tokenizer in qkv's own loop (warmup and cosine decay, clipping, checkpoints,
--resume, torchrun). The model's vocabulary is the preset's, grown to fit the tokenizer
when a larger one is given with --tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from qkv.models.configs.gpt2 import GPT_CONFIG_124M, GPTConfig


@dataclass(frozen=True)
class TrainPreset:
    """Defaults for one named run. The command line overrides the training values and the
    model's width, depth and heads (--emb-dim, --n-layers, --n-heads), window
    (--context-length) and dropout; `loop` and `tokenizer` are what the preset is."""

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
    grad_clip: float | None = 1.0  # None: no clipping (the book's)
    min_lr_ratio: float = 0.1  # the cosine decay's floor; 1.0 keeps the rate constant (the book's)
    tokenizer: Literal["bpe", "gpt2"] = "bpe"  # a BPE trained on the data, or GPT-2's (the book's)
    loop: Literal["qkv", "book"] = "qkv"  # qkv.training.loop, or the book's train_model_simple
    sample_tokens: int = 20  # tokens of the sample shown at each evaluation (the book: 50 per epoch)

    def __post_init__(self) -> None:
        if self.loop == "book" and self.tokenizer != "gpt2":
            raise ValueError(f"preset {self.name}: the book's loop trains on GPT-2's tokens")

    @property
    def tokenizer_vocab_size(self) -> int:
        """Target size of the byte-level BPE trained on the data."""
        return self.model.vocab_size


DEFAULT_PRESET = "tiny"
BOOK_SAVE_AT_END = 10**9  # the book saves once, after training (--save-every N adds more)

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
    "book": TrainPreset(
        name="book",
        model=replace(GPT_CONFIG_124M, context_length=256),  # chapter 5 shortens the context
        batch_size=2, epochs=10, lr=4e-4, weight_decay=0.1, warmup_steps=0,
        eval_every=5, save_every=BOOK_SAVE_AT_END, eval_windows=10,  # eval_iter=5 batches of 2
        grad_clip=None, min_lr_ratio=1.0, tokenizer="gpt2", loop="book", sample_tokens=50,
    ),
    "book-124m": TrainPreset(
        name="book-124m",
        model=replace(GPT_CONFIG_124M),
        batch_size=2, epochs=10, lr=4e-4, weight_decay=0.1, warmup_steps=0,
        eval_every=5, save_every=50, eval_windows=10, tokenizer="gpt2",
    ),
}
