"""The book's attention classes ("Build a Large Language Model (From Scratch)", chapter 3),
re-exported by qkv.book.

Constructor signatures, attribute names (W_query, W_key, W_value, out_proj, mask) and the
order in which parameters are created are the book's, so `torch.manual_seed(123)` followed
by construction reproduces the book's printed numbers, and a state_dict saved from the
book's code loads here unchanged. Underneath, each class calls qkv's functional core
(`qkv.attention.explicit_attention`) instead of repeating the arithmetic.

Shape legend: B batch, T tokens, H heads, D head size (d_out / num_heads).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.attention.kernels import explicit_attention


def _as_batched(x: Tensor, d_in: int, *, allow_unbatched: bool, name: str) -> tuple[Tensor, bool]:
    """Accept (B, T, d_in) (and (T, d_in) where the book does); return (B, T, d_in), was_unbatched."""
    ok_dims = (2, 3) if allow_unbatched else (3,)
    if x.dim() not in ok_dims or x.shape[-1] != d_in:
        expected = "(tokens, d_in) or (batch, tokens, d_in)" if allow_unbatched else "(batch, tokens, d_in)"
        raise ValueError(
            f"{name} expects x of shape {expected} with d_in={d_in}, got {tuple(x.shape)}"
        )
    if x.dim() == 2:
        return x.unsqueeze(0), True
    return x, False


def _check_context_length(num_tokens: int, context_length: int, name: str) -> None:
    if num_tokens > context_length:
        raise ValueError(
            f"{name} got {num_tokens} tokens but context_length={context_length}; "
            "pass at most context_length tokens or build it with a larger context_length"
        )


def _causal_buffer(context_length: int) -> Tensor:
    """The book's mask: 1 above the diagonal marks the future keys a query must not see."""
    return torch.triu(torch.ones(context_length, context_length), diagonal=1)


class SelfAttention_v1(nn.Module):
    """Section 3.4.2: trainable weights as three raw parameter matrices (query, key, value)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: Tensor) -> Tensor:
        xb, unbatched = _as_batched(x, self.d_in, allow_unbatched=True, name="SelfAttention_v1")
        keys = xb @ self.W_key  # (B, T, d_out)
        queries = xb @ self.W_query
        values = xb @ self.W_value
        context, _ = explicit_attention(queries, keys, values)
        return context[0] if unbatched else context


class SelfAttention_v2(nn.Module):
    """Section 3.4.2: the same with nn.Linear layers (better initialisation, optional bias)."""

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: Tensor) -> Tensor:
        xb, unbatched = _as_batched(x, self.d_in, allow_unbatched=True, name="SelfAttention_v2")
        context, _ = explicit_attention(self.W_query(xb), self.W_key(xb), self.W_value(xb))
        return context[0] if unbatched else context


class CausalAttention(nn.Module):
    """Section 3.5.3: self-attention that hides future tokens, with dropout on the weights."""

    mask: Tensor

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={dropout}")
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_buffer(context_length))

    def forward(self, x: Tensor) -> Tensor:
        xb, unbatched = _as_batched(x, self.d_in, allow_unbatched=False, name="CausalAttention")
        num_tokens = xb.shape[1]
        _check_context_length(num_tokens, self.context_length, "CausalAttention")
        visible = ~self.mask.bool()[:num_tokens, :num_tokens]  # (T, T), True = may attend
        p = self.dropout.p if self.training else 0.0
        context, _ = explicit_attention(
            self.W_query(xb), self.W_key(xb), self.W_value(xb), mask=visible, dropout_p=p
        )
        return context


class MultiHeadAttentionWrapper(nn.Module):
    """Section 3.6.1: several CausalAttention heads side by side, outputs concatenated.

    As in the book, each head produces d_out features, so the output has
    num_heads * d_out features.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be at least 1, got num_heads={num_heads}")
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([head(x) for head in self.heads], dim=-1)  # (B, T, H * d_out)


class MultiHeadAttention(nn.Module):
    """Section 3.6.2: one projection per role, split into heads, then an output projection."""

    mask: Tensor

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads < 1 or d_out % num_heads != 0:
            raise ValueError(
                f"d_out must be divisible by num_heads, got d_out={d_out}, num_heads={num_heads}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={dropout}")
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_buffer(context_length))

    def forward(self, x: Tensor) -> Tensor:
        xb, _ = _as_batched(x, self.d_in, allow_unbatched=False, name="MultiHeadAttention")
        b, num_tokens, _ = xb.shape
        _check_context_length(num_tokens, self.context_length, "MultiHeadAttention")

        def split_heads(t: Tensor) -> Tensor:
            return t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

        queries = split_heads(self.W_query(xb))
        keys = split_heads(self.W_key(xb))
        values = split_heads(self.W_value(xb))
        visible = ~self.mask.bool()[:num_tokens, :num_tokens]  # (T, T)
        p = self.dropout.p if self.training else 0.0
        context, _ = explicit_attention(queries, keys, values, mask=visible, dropout_p=p)
        context = context.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)  # (B, T, d_out)
        return self.out_proj(context)


__all__ = [
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
]

