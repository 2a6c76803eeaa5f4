"""The book's GPT model (chapter 4), which is GPT-2's architecture.

Names follow the book (tok_emb, pos_emb, trf_blocks, att, ff, norm1, norm2, final_norm,
out_head) and so does the config (vocab_size, context_length, emb_dim, n_heads, n_layers,
drop_rate, qkv_bias), so a reader of the book recognises every part. The attention `att`
is the shared `GroupedQueryAttention` with as many key/value heads as query heads (the
book's multi-head attention): its projections are q_proj, k_proj, v_proj and o_proj, the
book's W_query, W_key, W_value and out_proj (GPT-2's fused c_attn is split at load time,
qkv.models.key_maps.hf). Unlike the book's MultiHeadAttention it keeps no (context_length x
context_length) mask buffer: causality is passed to the kernel, and a KV cache can be
attached for generation.

Shape legend: B batch, T new tokens, S key tokens (cache included), C embedding (emb_dim),
H heads, D head size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.caches.kv_cache import KVCache
from qkv.models.configs.layer_spec import AttentionSpec, LayerSpec, MlpSpec, NormSpec
from qkv.models.decoder import CausalDecoder, HeadParts, LayerParts
from qkv.models.configs.gpt2 import GPT_CONFIG_124M, GPTConfig  # noqa: F401  (re-exported; torch-free home)


class LayerNorm(nn.Module):
    """Section 4.2: normalise each token's features, then scale and shift (learned)."""

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.scale, self.shift, self.eps)


class GELU(nn.Module):
    """Section 4.3: GPT-2's tanh approximation of GELU."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim), GELU(), nn.Linear(4 * cfg.emb_dim, cfg.emb_dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Section 4.5: pre-norm attention and feed-forward, each with a shortcut."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.att = GroupedQueryAttention(
            cfg.emb_dim, cfg.n_heads, qkv_bias=cfg.qkv_bias, out_bias=True,
            dropout=cfg.drop_rate, backend=cfg.attention_backend,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim, cfg.layer_norm_eps)
        self.norm2 = LayerNorm(cfg.emb_dim, cfg.layer_norm_eps)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: Tensor, *, mask: Tensor | None, positions: Tensor, cache: KVCache | None = None) -> Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x), mask=mask, positions=positions, cache=cache))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPT2Decoder(CausalDecoder):
    """Section 4.6: token + position embeddings, transformer blocks, final norm, output head.

    forward(input_ids (B, T), *, positions=None, mask=None, caches=None) -> logits (B, T, V).
    `positions` (T,) or (B, T) defaults to cache_length + arange(T); `mask` is a (B, S)
    key padding mask or a boolean mask broadcastable to (B, 1, T, S) for padded batches
    (see qkv.models.decoder). The output head may share its weight with tok_emb (GPT-2
    checkpoints do) or not (the book trains it separately).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = LayerNorm(cfg.emb_dim, cfg.layer_norm_eps)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    @property
    def context_length(self) -> int:
        return self.cfg.context_length

    def attention_layers(self) -> Iterator[GroupedQueryAttention]:
        return (block.att for block in self.trf_blocks)

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """GPT-2's layer as the family-neutral description every runtime executes: LayerNorms
        with a shift, no RoPE (positions are learned and added in `embed`), multi-head
        attention with biases, and a plain (ungated) tanh-GELU feed-forward of 4 x C."""
        cfg = self.cfg
        norm = NormSpec("layer", eps=cfg.layer_norm_eps, bias=True)
        spec = LayerSpec(
            attention=AttentionSpec(cfg.n_heads, cfg.n_heads, cfg.emb_dim // cfg.n_heads,
                                    qkv_bias=cfg.qkv_bias, out_bias=True),
            mlp=MlpSpec(4 * cfg.emb_dim, "gelu_tanh", gated=False, bias=True),
            rope=None, attn_norm=norm, mlp_norm=norm)
        return (spec,) * cfg.n_layers

    def layer_parts(self) -> list[LayerParts]:
        return [
            LayerParts(
                attn_norm=(block.norm1.scale, block.norm1.shift), attention=block.att,
                mlp_norm=(block.norm2.scale, block.norm2.shift), up=block.ff.layers[0],
                down=block.ff.layers[2],
            )
            for block in self.trf_blocks
        ]

    def tie_weights(self) -> None:
        """Share the output head's weight with the token embedding (as GPT-2 does)."""
        self.out_head.weight = self.tok_emb.weight

    @property
    def weights_tied(self) -> bool:
        return self.out_head.weight is self.tok_emb.weight

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.drop_emb(self.tok_emb(input_ids) + self.pos_emb(positions))  # (B, T, C)

    def head_parts(self) -> HeadParts:
        norm = NormSpec("layer", eps=self.final_norm.eps, bias=True)
        return HeadParts(norm=norm, norm_tensors=(self.final_norm.scale, self.final_norm.shift), head=self.out_head)

    def head(self, x: Tensor) -> Tensor:
        return self.out_head(self.final_norm(x))  # (B, T, V)

    def forward(
        self, input_ids: Tensor, *, positions: Tensor | None = None, mask: Tensor | None = None,
        caches: Sequence[KVCache] | None = None, last_only: bool = False,
    ) -> Tensor:
        """Logits (B, T, V); last_only: the last position's only, (B, 1, V) (a prompt's next token)."""
        positions, mask = self.call_arguments(input_ids, positions, mask, caches)  # (T,) or (B, T); bool
        x = self.embed(input_ids, positions)  # (B, T, C)
        for index, block in enumerate(self.trf_blocks):
            x = block(x, mask=mask, positions=positions, cache=None if caches is None else caches[index])
        return self.head(x[:, -1:] if last_only else x)  # (B, T, V) or (B, 1, V)


def __getattr__(name: str) -> type:
    """`GPTModel`, this class's name in 0.1 (now the book's class alone is GPTModel), for one release."""
    if name == "GPTModel":
        import warnings

        warnings.warn("qkv.models.gpt2.GPTModel is now GPT2Decoder (qkv.book.GPTModel is the book's class); "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return GPT2Decoder
    raise AttributeError(f"module 'qkv.models.gpt2' has no attribute {name!r}")
