"""The book's GPT ("Build a Large Language Model (From Scratch)", chapters 4 and 5).

`GPTModel(cfg)` takes the book's config dict (GPT_CONFIG_124M's keys: vocab_size,
context_length, emb_dim, n_heads, n_layers, drop_rate, qkv_bias) and has the book's
modules, in the book's order of creation: tok_emb, pos_emb, drop_emb, trf_blocks (an
nn.Sequential of TransformerBlock: att = qkv.book.MultiHeadAttention with W_query,
W_key, W_value, out_proj and its mask buffer (qkv.book.attention); ff.layers; norm1, norm2 with scale and
shift; drop_shortcut), final_norm and out_head. So `torch.manual_seed(123)` followed by
construction gives the book's weights, dropout draws the book's masks in the book's
order, and a state dict the book's code saved (`model.pth`) loads unchanged.
LayerNorm and GELU compute the book's formulas as written, not torch's fused kernels,
so their floating-point results are the book's too.

`to_qkv(model)` / `from_qkv(model)` convert to and from qkv's fast GPT
(qkv.models.gpt2.GPT2Decoder, whose attention is the shared GroupedQueryAttention with a KV
cache) without changing a number; `qkv.save_pretrained(to_qkv(model), gpt2_tokenizer(),
folder)` writes a Hugging Face GPT-2 folder.

Shape legend: B batch, T tokens, C embedding (emb_dim), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from qkv.book.attention import MultiHeadAttention
from qkv.models.key_maps import book as book_keys
from qkv.models.gpt2 import GPT2Decoder as FastGPT
from qkv.models.configs.gpt2 import GPTConfig

BOOK_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")

# The book's GPT_CONFIG_124M (section 4.1); chapter 5 trains it with context_length 256.
GPT_CONFIG_124M: dict[str, Any] = {
    "vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
    "drop_rate": 0.1, "qkv_bias": False,
}


def book_config(cfg: Mapping[str, Any] | GPTConfig) -> GPTConfig:
    """The book's config dict (or a GPTConfig) as a validated GPTConfig; a missing key is named."""
    if isinstance(cfg, GPTConfig):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(f"the book's GPT takes a config dict like GPT_CONFIG_124M, not {type(cfg).__name__}")
    missing = [k for k in BOOK_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"the GPT config lacks {', '.join(missing)} (the book's GPT_CONFIG_124M has {', '.join(BOOK_KEYS)})")
    return GPTConfig(**{k: cfg[k] for k in BOOK_KEYS})


class LayerNorm(nn.Module):
    """Section 4.2: each token's features to mean 0 and variance 1, then scale and shift."""

    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(dim=-1, keepdim=True)  # (B, T, 1)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # (B, T, 1), the biased variance
        return self.scale * ((x - mean) / torch.sqrt(var + self.eps)) + self.shift


class GELU(nn.Module):
    """Section 4.3: GPT-2's tanh approximation of GELU."""

    def forward(self, x: Tensor) -> Tensor:
        root = torch.sqrt(torch.tensor(2.0 / torch.pi))
        return 0.5 * x * (1 + torch.tanh(root * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    """Section 4.3: widen to 4 x emb_dim, GELU, narrow back."""

    def __init__(self, cfg: Mapping[str, Any] | GPTConfig) -> None:
        super().__init__()
        c = book_config(cfg).emb_dim
        self.layers = nn.Sequential(nn.Linear(c, 4 * c), GELU(), nn.Linear(4 * c, c))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Section 4.5: pre-norm multi-head attention and feed-forward, each with a shortcut."""

    def __init__(self, cfg: Mapping[str, Any] | GPTConfig) -> None:
        super().__init__()
        c = book_config(cfg)
        self.att = MultiHeadAttention(
            d_in=c.emb_dim, d_out=c.emb_dim, context_length=c.context_length,
            dropout=c.drop_rate, num_heads=c.n_heads, qkv_bias=c.qkv_bias,
        )
        self.ff = FeedForward(c)
        self.norm1 = LayerNorm(c.emb_dim)
        self.norm2 = LayerNorm(c.emb_dim)
        self.drop_shortcut = nn.Dropout(c.drop_rate)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x)))  # (B, T, C)
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(nn.Module):
    """Section 4.6: token + position embeddings, transformer blocks, final norm, output head.

    forward(in_idx (B, T)) -> logits (B, T, V), T at most context_length (as in the book,
    longer inputs are an error: generate_text_simple crops them first).
    """

    def __init__(self, cfg: Mapping[str, Any] | GPTConfig) -> None:
        super().__init__()
        c = book_config(cfg)
        self.cfg = c
        self.tok_emb = nn.Embedding(c.vocab_size, c.emb_dim)
        self.pos_emb = nn.Embedding(c.context_length, c.emb_dim)
        self.drop_emb = nn.Dropout(c.drop_rate)
        self.trf_blocks = nn.Sequential(*[TransformerBlock(c) for _ in range(c.n_layers)])
        self.final_norm = LayerNorm(c.emb_dim)
        self.out_head = nn.Linear(c.emb_dim, c.vocab_size, bias=False)

    def forward(self, in_idx: Tensor) -> Tensor:
        if in_idx.dim() != 2:
            raise ValueError(f"GPTModel expects token ids of shape (batch, tokens), got {tuple(in_idx.shape)}")
        seq_len = in_idx.shape[1]
        if seq_len > self.cfg.context_length:
            raise ValueError(
                f"GPTModel got {seq_len} tokens but context_length={self.cfg.context_length}; "
                "crop the input to the last context_length tokens (generate_text_simple does)"
            )
        tok_embeds = self.tok_emb(in_idx)  # (B, T, C)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))  # (T, C)
        x = self.drop_emb(tok_embeds + pos_embeds)
        x = self.trf_blocks(x)
        return self.out_head(self.final_norm(x))  # (B, T, V)


def generate_text_simple(model: nn.Module, idx: Tensor, max_new_tokens: int, context_size: int) -> Tensor:
    """Section 4.7: greedy decoding that feeds the last `context_size` tokens every step.

    idx (B, T) -> (B, T + max_new_tokens). Without a cache each step recomputes the whole
    window, which is why the book's loop can crop the window and go on past the context.
    """
    for _ in range(max_new_tokens):
        window = idx[:, -context_size:]  # (B, <= context_size)
        with torch.no_grad():
            logits = model(window)[:, -1, :]  # (B, V)
        next_id = torch.argmax(logits, dim=-1, keepdim=True)  # (B, 1)
        idx = torch.cat((idx, next_id), dim=1)
    return idx


def to_qkv(model: GPTModel) -> FastGPT:
    """The same weights in qkv's fast GPT (eval mode, KV cache, fused kernels); nothing is shared."""
    fast = FastGPT(model.cfg)
    fast.load_state_dict(book_keys.book_to_qkv_state(model.state_dict(), model.cfg), strict=True)
    return fast.eval()


def from_qkv(model: FastGPT) -> GPTModel:
    """qkv's fast GPT (or a loaded GPT-2) as the book's GPTModel, weights copied; a tied output
    head becomes the book's separate out_head with the embedding's values."""
    cfg = model.cfg
    book = GPTModel(cfg)
    book.load_state_dict(book_keys.qkv_to_book_state(model.state_dict(), cfg), strict=True)
    return book.train(model.training)


def parameter_count(model: nn.Module) -> int:
    """Parameters as the book counts them (section 4.6: 163,009,536 for GPT_CONFIG_124M)."""
    return sum(p.numel() for p in model.parameters())


def model_size_mb(model: nn.Module) -> float:
    """The book's estimate of the model's size: float32 parameters, in MB (2**20 bytes)."""
    return parameter_count(model) * 4 / 2**20


__all__ = [
    "FeedForward", "GELU", "GPTModel", "GPT_CONFIG_124M", "LayerNorm", "TransformerBlock",
    "from_qkv", "generate_text_simple", "model_size_mb", "parameter_count", "to_qkv",
]
