"""The terminal table of one query's keys (qkv.trace.render.terminal.render_layer): its
scaled-score column says what the scores are multiplied by, 1/sqrt(d_k) where the layer
scales so (GPT-2) and not where it does not (Gemma 2's query_pre_attn_scalar), on tiny
random models built by transformers and qkv."""

from __future__ import annotations

import io

import torch
from rich.console import Console
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import qkv
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.trace import trace
from qkv.trace.render.terminal import render_layer


def _table_header(layer, head: int = 0) -> list[str]:
    out = io.StringIO()
    render_layer(Console(file=out, width=80, color_system=None), layer, None, head=head, query=layer.queries[-1])
    lines = out.getvalue().splitlines()
    rule = next(i for i, line in enumerate(lines) if line.strip().startswith("───"))
    return lines[rule - 2: rule]  # the two header lines above the rule


def test_gpt2_scaled_column_says_one_over_sqrt_dk():
    torch.manual_seed(1)
    model = GPT2Decoder(GPTConfig(vocab_size=30, context_length=16, emb_dim=16, n_heads=4, n_layers=1)).eval()
    layer = trace(model, torch.tensor([[1, 2, 3, 4, 5]])).layers[0]
    assert layer.head_dim == 4 and layer.scale == 0.5
    top, bottom = _table_header(layer)
    assert "× 1/sqrt(d_k)" in top and "= 0.5000" in bottom and "q · k" in bottom


def test_a_layer_with_its_own_scale_is_not_called_one_over_sqrt_dk(tmp_path):
    import transformers as tf

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["The cat sat on the mat."] * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = tf.Gemma2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             query_pre_attn_scalar=24, max_position_embeddings=64, bos_token_id=None,
                             eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    tf.Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    model, _ = qkv.load_pretrained(tmp_path)
    layer = trace(model, torch.tensor([[5, 6, 7, 8]])).layers[0]
    assert layer.head_dim == 16 and abs(layer.scale - 24 ** -0.5) < 1e-7
    top, bottom = _table_header(layer)
    assert "1/sqrt(d_k)" not in top + bottom and "× scale" in top and f"= {24 ** -0.5:.4f}" in bottom
