"""The interface every qkv decoder shares, so generation, tracing and benchmarks need not
know which family they drive.

    model(input_ids (B, T), *, positions=None, mask=None) -> logits (B, T, V)
    model.setup_cache(batch_size, capacity, *, dtype=None, device=None, kind=StaticKVCache)
    model.reset_cache(); model.remove_cache(); model.cache_length(); model.context_length

`positions` (T,) or (B, T) are absolute token positions, tensors; by default they follow
what the caches hold (or start at 0 without caches). With caches attached, each attention
layer writes its keys/values at those positions and attends through the mask its cache
derives from them; without, causality is applied by the kernel. `mask` is an extra
boolean mask broadcastable to (B, 1, T, S) or a (B, S) key padding mask (True/1 = real
token), for whole-sequence calls on left-padded batches.

Every attention layer keeps its KV cache as a submodule named `kv_cache`; which kind of
cache is the caller's choice (`kind`), the models never look inside one. Code that owns a
cache's lifetime is `qkv.generation.DecodeSession`.

Shape legend: B batch, T new tokens, S key tokens (cache included), V vocabulary.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from qkv.attention.kv_cache import CacheKind, KVCache, StaticKVCache
from qkv.attention.rope import RotaryEmbedding

if TYPE_CHECKING:
    from qkv.attention.grouped_query import GroupedQueryAttention
    from qkv.perf.fused_layers import FusedLayers


def key_mask(mask: Tensor | None) -> Tensor | None:
    """A (B, S) key padding mask becomes (B, 1, 1, S) booleans; other masks pass unchanged."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    return mask


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer told in family-neutral terms, for a kernel that runs its whole
    decode step (`qkv.perf.fused_layers`): x + attention(norm(x)), then + down(act(up(norm(x))))."""

    attn_norm: tuple[Tensor, ...]  # (weight,): RMSNorm; (weight, bias): LayerNorm
    attention: GroupedQueryAttention
    mlp_norm: tuple[Tensor, ...]
    up: nn.Module  # a SwiGLU's stacked gate_up_proj, or GPT-2's first feed-forward layer
    down: nn.Module
    activation: Literal["silu_gated", "gelu_tanh"]
    eps: float  # the norms' (q/k norms included)


class CausalDecoder(nn.Module, metaclass=ABCMeta):
    """Cache management shared by the decoders; subclasses list their attention layers.

    `eos_token_ids` are the tokens that end a generation (from the checkpoint's config;
    empty when unknown).
    """

    eos_token_ids: tuple[int, ...] = ()
    # True when the loader read the layer weights from 4-bit blocks (a Q4_0/Q4_1 GGUF file):
    # the default decode precision is then int4 (qkv.precision).
    stored_in_four_bits: bool = False
    # Set by qkv.perf.prepare_for_decoding where qkv's kernels run whole layers: decode
    # steps then go through it (`fused_step`), everything else through the layers.
    fused_layers: FusedLayers | None = None

    @abstractmethod
    def attention_layers(self) -> Iterator[nn.Module]:
        """Every attention layer, in order; each has `setup_cache()` and `kv_cache`."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """The most positions the model can attend over."""

    def layer_parts(self) -> list[LayerParts] | None:
        """The layers as `LayerParts`, or None when this family's layers cannot be told so."""
        return None

    def fused_step(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor | None:
        """x (B, 1, C) after every layer when the fused layers take this call (a decode
        step, float32, no grad, caches they can write), else None: run the layers."""
        fused = self.fused_layers
        if fused is None or self.training or not fused.takes(x, positions, mask):
            return None
        return fused(x, positions)

    def rotary_embedding(self) -> RotaryEmbedding | None:
        """The model's RoPE, handed to caches that rotate keys themselves (None: no RoPE)."""
        return None

    def streams_past_context(self, kind: CacheKind) -> bool:
        """Whether caches of `kind` let this model run past its context length: a kind that
        evicts old tokens (`streams`) on a model with RoPE, where the cache re-numbers the
        positions it rotates by. Learned absolute positions (GPT-2) cannot be re-numbered."""
        cls = getattr(kind, "func", kind)  # a kind is a class or a functools.partial of one
        return bool(getattr(cls, "streams", False)) and self.rotary_embedding() is not None

    def rope_positions(self, positions: Tensor) -> Tensor:
        """The positions RoPE rotates the new tokens by (the caches' say; see KVCache)."""
        cache = self.first_cache()
        return cache.rope_positions(positions) if cache is not None else positions

    def first_cache(self) -> KVCache | None:
        """The first attention layer's cache (every layer has one of the same kind, or none):
        what per-call checks ask, without walking every layer."""
        first = next(iter(self.attention_layers()), None)
        return None if first is None else first.kv_cache

    def position_limit(self) -> int:
        """One past the furthest true position a call may reach with the attached caches."""
        cache = self.first_cache()
        if cache is None:
            return self.context_length
        if cache.rotates_keys:  # rotation stays inside the cache: no context limit
            return cache.max_position
        return min(self.context_length, cache.max_position)

    def setup_cache(
        self,
        batch_size: int,
        capacity: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kind: CacheKind = StaticKVCache,
    ) -> None:
        """Attach an empty KV cache of `kind` holding `capacity` positions to every
        attention layer (dtype and device default to the model's)."""
        if capacity > self.context_length:
            raise ValueError(
                f"a cache of {capacity} tokens exceeds the model's context length "
                f"({self.context_length})"
            )
        reference = next(self.parameters())
        dtype = reference.dtype if dtype is None else dtype
        device = reference.device if device is None else torch.device(device)
        rotary = self.rotary_embedding()
        for index, layer in enumerate(self.attention_layers()):
            layer.setup_cache(batch_size, capacity, dtype=dtype, device=device, kind=kind, layer_index=index,
                              rotary=rotary)
        if self.fused_layers is not None:
            self.fused_layers.bind(self)

    def caches(self) -> list[KVCache]:
        return [layer.kv_cache for layer in self.attention_layers() if layer.kv_cache is not None]

    def reset_cache(self) -> None:
        """Forget the cached tokens, keeping the buffers for the next generation."""
        for cache in self.caches():
            cache.reset()

    def remove_cache(self) -> None:
        """Detach the caches: the model runs on whole sequences again."""
        for layer in self.attention_layers():
            layer.kv_cache = None
        if self.fused_layers is not None:
            self.fused_layers.unbind()

    def cache_length(self) -> int:
        """How many positions the attached caches hold (0 without caches)."""
        cache = self.first_cache()
        return cache.length if cache is not None else 0

    def cache_nbytes(self) -> int:
        """Bytes held by all attached KV caches."""
        return sum(cache.nbytes for cache in self.caches())

    def call_arguments(
        self, input_ids: Tensor, positions: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """What every decoder's forward starts with: checked ids, the positions of the new
        tokens (`positions_for`) and the mask as booleans (`key_mask`)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        return self.positions_for(input_ids, positions), key_mask(mask)

    def positions_for(self, input_ids: Tensor, positions: Tensor | None) -> Tensor:
        """The positions of the new tokens, (T,) or (B, T): the given ones, or those that
        follow the cached tokens. Checks them against the context length and the caches'
        capacity (one small read of a tensor per call, outside any compiled region)."""
        t = input_ids.shape[1]
        cache = self.first_cache()
        if positions is None:
            if cache is not None:
                start = cache.length
                positions = torch.arange(start, start + t, device=input_ids.device)  # (T,)
            else:
                positions = torch.arange(t, device=input_ids.device)  # (T,)
        if positions.shape[-1] != t or positions.dim() not in (1, 2):
            raise ValueError(
                f"positions must have shape ({t},) or (batch, {t}), got {tuple(positions.shape)}"
            )
        if positions.numel():
            rope = cache.rope_positions(positions) if cache is not None else positions
            if rope is positions:  # one read of a tensor instead of two
                furthest = rope_furthest = int(positions.max()) + 1
            else:
                furthest, rope_furthest = (int(n) + 1 for n in torch.stack([positions.max(), rope.max()]).tolist())
        else:
            furthest = rope_furthest = 0
        limit = self.position_limit()
        if furthest > limit:
            what = "context length" if limit == self.context_length else "KV cache's capacity"
            raise ValueError(
                f"{furthest} tokens exceed the model's {what} ({limit}); shorten the input"
            )
        if rope_furthest > self.context_length:
            raise ValueError(
                f"this call rotates tokens up to position {rope_furthest}, past the model's context "
                f"length ({self.context_length}); feed fewer tokens per call"
            )
        return positions
