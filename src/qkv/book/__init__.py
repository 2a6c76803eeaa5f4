"""The book's classes ("Build a Large Language Model (From Scratch)"), with the book's names.

Chapter 3's attention classes (qkv.book.attention) and chapter 4's GPT built on them
(qkv.book.gpt), in one place so that `from qkv.book import GPTModel, MultiHeadAttention`
reads as the book's own imports do. Constructor signatures, attribute names and the order
in which parameters are made are the book's, so a seed reproduces the book's numbers and
the book's state dicts load unchanged.
"""

from qkv.book.attention import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from qkv.book.gpt import (
    GELU,
    GPT_CONFIG_124M,
    FeedForward,
    GPTModel,
    LayerNorm,
    TransformerBlock,
    from_qkv,
    generate_text_simple,
    model_size_mb,
    parameter_count,
    to_qkv,
)

__all__ = [
    "CausalAttention", "FeedForward", "GELU", "GPTModel", "GPT_CONFIG_124M", "LayerNorm",
    "MultiHeadAttention", "MultiHeadAttentionWrapper", "SelfAttention_v1", "SelfAttention_v2",
    "TransformerBlock", "from_qkv", "generate_text_simple", "model_size_mb", "parameter_count", "to_qkv",
]
