"""Tiny random-weight decoders (GPT-2, Llama with grouped-query attention and Llama-3 RoPE,
Qwen2 with q/k/v biases, Qwen3 with q/k-norm), built by transformers, saved with a tokenizer.json made by
`tokenizers`, loaded back by qkv.load_pretrained: the trace is checked against
transformers' eager attentions on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 288  # the byte-level alphabet (256) and some merges: the tokenizer fits the model


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["Your journey starts with one step.", "The cat sat on the mat."] * 4, trainer)
    return tok


def _config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    if kind == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                             initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return tf.LlamaConfig(**common, rope_parameters=rope)
    if kind == "qwen2":
        return tf.Qwen2Config(**common)  # q/k/v biases
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory):
    """kind -> (folder, transformers model with eager attention). Built once per session."""
    import transformers as tf

    made: dict[str, tuple[Path, object]] = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            torch.manual_seed(11)
            model_class = {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM,
                           "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[kind]
            model_class(_config(kind)).save_pretrained(folder)
            _tokenizer().save(str(folder / "tokenizer.json"))
            reference = model_class.from_pretrained(str(folder), attn_implementation="eager").eval()
            made[kind] = (folder, reference)
        return made[kind]

    return make
