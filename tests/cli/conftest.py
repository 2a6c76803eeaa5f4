"""Fixtures shared by the CLI tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random Llama (4 query heads sharing 2 key/value heads) saved like a real checkpoint."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["The cat sat on the mat."] * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, initializer_range=0.3, bos_token_id=None,
                            eos_token_id=None)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    reference = tf.LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    return folder, reference, tok
