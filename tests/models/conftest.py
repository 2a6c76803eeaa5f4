"""Fixtures for model tests: tiny random-weight Hugging Face checkpoints, built by
transformers and saved to tmp_path with a tokenizer.json trained by `tokenizers`.

Weights are drawn with a large initializer_range so logits are far from flat and greedy
choices are never near-ties between tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 288  # = the tokenizer's size: byte alphabet (256) + 32 merges
CORPUS = [
    "Your journey starts with one step.",
    "Keys, queries and values: attention from the key up.",
    "Every effort moves you forward; naïve café déjà vu — ünïcödé ✓.",
]


def make_tokenizer(vocab_size: int = VOCAB) -> Tokenizer:
    """A byte-level BPE tokenizer trained on a few sentences (multi-byte characters included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def hf_config(kind: str, **overrides: Any) -> Any:
    """A tiny transformers config: 2 layers, hidden 64."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    llama_like = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
    )
    if kind == "gpt2":
        cfg = dict(n_positions=96, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3, vocab_size=VOCAB)
        return tf.GPT2Config(**{**cfg, "bos_token_id": None, "eos_token_id": None, **overrides})
    if kind == "llama":
        rope = {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }
        return tf.LlamaConfig(**{**common, **llama_like, "rope_parameters": rope, "tie_word_embeddings": False, **overrides})
    if kind == "qwen2":
        return tf.Qwen2Config(**{**common, **llama_like, "tie_word_embeddings": True, **overrides})
    if kind == "qwen3":
        return tf.Qwen3Config(**{**common, **llama_like, "head_dim": 24, "tie_word_embeddings": False, **overrides})
    raise ValueError(kind)


def hf_model_class(kind: str) -> Any:
    import transformers as tf

    return {
        "gpt2": tf.GPT2LMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
    }[kind]


def save_tiny(kind: str, folder: Path, *, seed: int = 0, **overrides: Any) -> Any:
    """Build a random transformers model, save it with a tokenizer.json; return the model."""
    torch.manual_seed(seed)
    model = hf_model_class(kind)(hf_config(kind, **overrides)).eval()
    model.save_pretrained(folder)
    make_tokenizer().save(str(folder / "tokenizer.json"))
    return model


@pytest.fixture
def tiny_checkpoint(tmp_path: Path):
    """factory(kind, **config overrides) -> (folder, transformers model)."""

    def make(kind: str, **overrides: Any) -> tuple[Path, Any]:
        folder = tmp_path / kind
        return folder, save_tiny(kind, folder, **overrides)

    return make


@pytest.fixture
def tokenizer() -> Tokenizer:
    return make_tokenizer()


@pytest.fixture
def hf_class():
    """kind -> the transformers model class."""
    return hf_model_class


@pytest.fixture(scope="session")
def shared_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Like tiny_checkpoint, but built once per session per config: read it, never modify it."""
    made: dict[tuple[str, tuple[tuple[str, Any], ...]], tuple[Path, Any]] = {}

    def make(kind: str, **overrides: Any) -> tuple[Path, Any]:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[key] = (folder, save_tiny(kind, folder, **overrides))
        return made[key]

    return make
