"""One rank's slice of a decoder: a `SpecDecoder` built from the rank's own description (its
query and KV heads, its feed-forward features, its vocabulary rows), plus the collectives
that make its outputs the whole model's.

    x = embed: each rank looks up the ids in its vocabulary rows (zeros elsewhere), all-reduce
    per layer: attention over the rank's heads -> o_proj over its columns  -> all-reduce
               MLP over the rank's features     -> down_proj over its columns -> all-reduce
    head: each rank's vocabulary rows of the logits, all-gathered into (B, T, V)

Row-parallel products (o_proj, down_proj) give partial sums, which the all-reduce adds up
before anything non-linear (Gemma's post-norms) reads them; a bias of theirs is held by rank 0
only (the others hold zeros). A q/k norm over every head at once (OLMo 2) is a `SplitRMSNorm`:
one more all-reduce, of its sum of squares, in each layer's attention. The collectives hang on
the attention and MLP modules as forward hooks, modules no preparation replaces (preparation
swaps the linear layers inside them); the model names them (`own_hooks`), so a session still
runs a decode step natively, as qkv.runtime.tensor_parallel splits the layer at the same
all-reduces, where a caller's hooks would make it run the modules. The soft-cap of the logits is applied to
each rank's stretch before the gather, so every rank holds the same bytes of logits and
samples the same token from the same seed.

Shape legend: B batch, T tokens, C hidden size, V vocabulary, V_r a rank's vocabulary rows, W_r a rank's
channels of a split q/k norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.models.configs.decoder_spec import DecoderSpec
from qkv.models.decoder import LayerParts
from qkv.models.spec_decoder import SpecDecoder
from qkv.models.tensor_parallel.assignment import RankShare
from qkv.models.tensor_parallel.group import TensorParallel


def rank_spec(spec: DecoderSpec, share: RankShare) -> DecoderSpec:
    """The description of the modules rank `share.rank` holds."""
    layers = tuple(
        dataclasses.replace(
            layer,
            attention=dataclasses.replace(layer.attention, num_heads=len(share.query_heads),
                                          num_kv_heads=len(share.kv_heads)),
            mlp=dataclasses.replace(layer.mlp, intermediate_size=len(share.features)),
        )
        for layer in spec.layers
    )
    return dataclasses.replace(spec, layers=layers, vocab_size=len(share.vocabulary))


class SplitRMSNorm(nn.Module):
    """An RMS norm over a width split across the ranks (OLMo 2's q/k norm spans every head):
    each rank holds its heads' channels and their weights; the sum of squares is all-reduced,
    so every rank divides by the whole width's statistic, as `RMSNorm` over all of it does."""

    def __init__(self, norm: nn.Module, width: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps, self.width, self.tp = norm.eps, width, tp

    def forward(self, x: Tensor) -> Tensor:  # (B, T, W_r) -> (B, T, W_r)
        x32 = x.float()
        squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True), "all-reduce of the q/k norm's statistic")
        return self.weight * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class TensorParallelDecoder(SpecDecoder):
    """forward(input_ids (B, T), ...) -> the whole model's logits (B, T, V) on every rank, from
    this rank's slice (module docstring). `spec` and `cfg` describe the whole model (what
    callers check a request against); `rank_spec` the modules this rank holds."""

    def __init__(self, spec: DecoderSpec, share: RankShare, tp: TensorParallel, *, cfg: Any = None) -> None:
        local = rank_spec(spec, share)
        super().__init__(local, backend="fused")
        self.rank_spec = local
        self.spec = spec
        self.cfg = spec if cfg is None else cfg
        self.share = share
        self.tp = tp
        # Rank 0 of a server (qkv.runtime.tensor_parallel_steps): the other ranks run only the
        # steps it shares with them, so a model call outside one (an explorer trace) is refused
        # with this reason instead of waiting on collectives no other rank makes.
        self.unshared_refusal: str | None = None
        self.in_shared_step = False
        own: list[int] = []
        for layer, whole in zip(self.model.layers, spec.layers):
            attention = layer.self_attn
            if whole.attention.qk_norm is not None and whole.attention.qk_norm_over == "all":
                if getattr(attention.q_norm, "weight_offset", 0.0):
                    raise AssertionError("a q/k norm over all heads with a weight offset: no family has one")
                a = whole.attention
                attention.q_norm = SplitRMSNorm(attention.q_norm, a.num_heads * a.head_dim, tp)
                attention.k_norm = SplitRMSNorm(attention.k_norm, a.num_kv_heads * a.head_dim, tp)
            hooks = (layer.self_attn.register_forward_hook(self._reduce_attention),
                     layer.mlp.register_forward_hook(self._reduce_mlp))
            own.extend(hook.id for hook in hooks)
        self.own_hooks = frozenset(own)  # not a caller's hooks: a session may still run the native step

    def _reduce_attention(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return self.tp.all_reduce(output, "all-reduce after attention")

    def _reduce_mlp(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return self.tp.all_reduce(output, "all-reduce after the MLP")

    def layer_parts(self) -> None:
        """None: the whole-layer native step would step past the all-reduces (a rank runs each
        layer's native call in two parts instead: qkv.runtime.tensor_parallel)."""
        return None

    def rank_layer_parts(self) -> list[LayerParts]:
        """What this rank's layers hand the native layer step (SpecDecoder's `layer_parts`)."""
        parts = super().layer_parts()
        assert parts is not None
        return parts

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        if self.unshared_refusal is not None and not self.in_shared_step:
            raise QkvError(self.unshared_refusal)
        vocab = self.share.vocabulary
        mine = (input_ids >= vocab.start) & (input_ids < vocab.stop)  # (B, T)
        local = torch.where(mine, input_ids - vocab.start, torch.zeros_like(input_ids))
        x = self.model.embed_tokens(local)  # (B, T, C)
        x = x * mine.unsqueeze(-1).to(x.dtype)  # rows of other ranks' tokens: zeros
        x = self.tp.all_reduce(x.contiguous(), "all-reduce after the embedding")
        if self.spec.embedding_scale is not None:
            x = x * torch.tensor(self.spec.embedding_scale, dtype=x.dtype)
        return x

    def head(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.model.norm(x))  # (B, T, V_r)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        stretch = -(-self.spec.vocab_size // self.share.world)
        if logits.shape[-1] < stretch:  # the last stretch is short: pad it for the gather
            logits = torch.nn.functional.pad(logits, (0, stretch - logits.shape[-1]))
        parts = self.tp.all_gather(logits.contiguous(), "all-gather of the logits")
        return torch.cat(parts, dim=-1)[..., : self.spec.vocab_size]  # (B, T, V)
