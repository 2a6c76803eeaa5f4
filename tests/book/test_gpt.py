"""The book's chapter-4 GPT (qkv.book): the book's printed numbers from its seed, the same
logits as transformers' GPT2LMHeadModel, and lossless conversion to and from qkv's fast GPT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.book import (
    GELU, GPT_CONFIG_124M, GPTModel, LayerNorm, TransformerBlock, from_qkv, generate_text_simple,
    model_size_mb, parameter_count, to_qkv,
)
from qkv.models.hf.checkpoint import save_pretrained
from qkv.models.hf.gpt2_tokenizer import gpt2_tokenizer

SMALL = {"vocab_size": 300, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
         "drop_rate": 0.1, "qkv_bias": False}


@pytest.mark.slow
def test_seed_123_reproduces_the_books_printed_numbers():
    torch.manual_seed(123)
    model = GPTModel(GPT_CONFIG_124M)  # section 4.6, in training mode as the book calls it
    assert parameter_count(model) == 163_009_536
    assert f"{model_size_mb(model):.2f}" == "621.83"
    batch = torch.tensor([[6109, 3626, 6100, 345], [6109, 1110, 6622, 257]])
    out = model(batch)  # dropout on: the book's masks, drawn in the book's order
    printed = {(0, 0): [0.3613, 0.4222, -0.0711], (1, 2): [1.0558, 1.0318, -0.2800]}
    for (b, t), values in printed.items():
        torch.testing.assert_close(out[b, t, :3], torch.tensor(values), atol=6e-5, rtol=0)
    torch.testing.assert_close(out[0, 0, -3:], torch.tensor([0.3483, 0.4661, -0.2838]), atol=6e-5, rtol=0)
    model.eval()
    ids = torch.tensor([gpt2_tokenizer().encode("Hello, I am").ids])  # section 4.7
    out = generate_text_simple(model, ids, max_new_tokens=6, context_size=1024)
    assert out.tolist() == [[15496, 11, 314, 716, 27018, 24086, 47843, 30961, 42348, 7267]]
    assert gpt2_tokenizer().decode(out[0].tolist()) == "Hello, I am Featureiman Byeswickattribute argue"


def test_layer_norm_and_gelu_are_torchs_up_to_rounding():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32) * 3
    norm = LayerNorm(32)
    with torch.no_grad():
        norm.scale.uniform_(0.5, 1.5)
        norm.shift.uniform_(-1, 1)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (32,), norm.scale, norm.shift, 1e-5))
    torch.testing.assert_close(GELU()(x), F.gelu(x, approximate="tanh"))


def test_module_names_are_the_books():
    torch.manual_seed(1)
    model = GPTModel(SMALL)
    names = set(model.state_dict())
    for name in ("tok_emb.weight", "pos_emb.weight", "trf_blocks.1.att.W_query.weight", "trf_blocks.0.att.W_key.weight",
                 "trf_blocks.0.att.W_value.weight", "trf_blocks.0.att.out_proj.bias", "trf_blocks.0.att.mask",
                 "trf_blocks.0.ff.layers.2.weight", "trf_blocks.0.norm1.scale", "trf_blocks.0.norm2.shift",
                 "final_norm.shift", "out_head.weight"):
        assert name in names
    assert isinstance(model.trf_blocks, torch.nn.Sequential)
    assert isinstance(model.trf_blocks[0], TransformerBlock)
    with pytest.raises(ValueError, match="lacks n_heads"):
        GPTModel({k: v for k, v in SMALL.items() if k != "n_heads"})
    with pytest.raises(ValueError, match="context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_conversion_to_qkv_and_back_is_lossless(qkv_bias):
    torch.manual_seed(2)
    book = GPTModel({**SMALL, "qkv_bias": qkv_bias}).eval()
    fast = to_qkv(book)
    back = from_qkv(fast)
    for name, tensor in book.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    ids = torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(fast(ids), book(ids), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(back.eval()(ids), book(ids), atol=0, rtol=0)


def test_hugging_face_folder_gives_the_books_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    book = GPTModel({**SMALL, "vocab_size": 50257}).eval()
    save_pretrained(to_qkv(book), gpt2_tokenizer(), tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, book(ids), atol=2e-5, rtol=1e-5)


def test_a_loaded_gpt2_becomes_the_books_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from qkv.models.loader import load_pretrained

    torch.manual_seed(4)
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    hf = transformers.GPT2LMHeadModel(cfg).eval()  # q/k/v biases and a tied head, as GPT-2's
    hf.save_pretrained(tmp_path)
    gpt2_tokenizer().save(str(tmp_path / "tokenizer.json"))
    fast, _ = load_pretrained(tmp_path)
    book = from_qkv(fast).eval()
    assert book.cfg.qkv_bias
    ids = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(book(ids), hf(ids).logits, atol=2e-5, rtol=1e-5)
    # The book's generate_text_simple crops its window and goes on past the context.
    out = generate_text_simple(book, ids[:, :4], max_new_tokens=20, context_size=16)
    assert out.shape == (1, 24)
