"""The interface every qkv decoder shares, so generation, tracing and benchmarks need not
know which family they drive.

    model(input_ids (B, T), *, positions=None, mask=None, caches=None) -> logits (B, T, V)
    model.embed(input_ids, positions) -> x (B, T, C);  model.head(x) -> logits (B, T, V)
    model.cache_specs(batch_size, capacity, dtype=..., device=...) -> one CacheSpec per layer

A model is pure: it holds its weights and nothing of a generation. `caches` is one KV
cache per attention layer, in order, owned by the caller's decode session
(`qkv.runtime.DecodeSession`, which builds them from `cache_specs`); the models never look
inside one. `positions` (T,) or (B, T) are absolute token positions, tensors; by default
they follow what the caches hold (or start at 0 without caches). With caches, each
attention layer writes its keys/values at those positions and attends through the mask its
cache derives from them; without, causality is applied by the kernel. `mask` is an extra
boolean mask broadcastable to (B, 1, T, S) or a (B, S) key padding mask (True/1 = real
token), for whole-sequence calls on left-padded batches. `embed` and `head` are the two
ends of `forward`, for a runtime that runs the layers in between its own way.

Shape legend: B batch, T new tokens, S key tokens (cache included), V vocabulary.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, KVCache
from qkv.attention.rope import RotaryEmbedding
from qkv.models.configs.layer_spec import LayerSpec, NormSpec

if TYPE_CHECKING:
    from qkv.attention.grouped_query import GroupedQueryAttention


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
    """One decoder layer's tensors told in family-neutral terms, for a kernel that runs its
    whole decode step (`qkv.runtime.layer_step`):
    x + post_norm(attention(norm(x))), then + post_norm(down(act(up(norm(x))))).

    A model that describes its layers (`layer_specs()`, qkv.models.configs.layer_spec) gives here the
    tensors its descriptions name: the post-norms' weights, the q/k norms' stored weights (any
    weight offset is the description's), and each layer's RoPE frequencies (None: NoPE), so
    the kernel rotates by the very numbers the modules do. What each layer is (norm kinds,
    activation, gating, eps) is its description's to say, never these tensors'."""

    attn_norm: tuple[Tensor, ...]  # (weight,): RMSNorm; (weight, bias): LayerNorm
    attention: GroupedQueryAttention
    mlp_norm: tuple[Tensor, ...]
    up: nn.Module  # a gated MLP's stacked gate_up_proj, or GPT-2's first feed-forward layer
    down: nn.Module
    attn_post_norm: tuple[Tensor, ...] | None = None
    mlp_post_norm: tuple[Tensor, ...] | None = None
    q_norm: Tensor | None = None  # (D,) per-head q/k norm weights, as stored
    k_norm: Tensor | None = None
    inv_freq: Tensor | None = None  # (R/2,) the layer's RoPE frequencies (None: no RoPE, or unknown)


@dataclass(frozen=True)
class HeadParts:
    """The far end of a decoder told in family-neutral terms, for a kernel that runs the whole
    decode step (`qkv.runtime.layer_step`): logits = softcap(head(norm(x))). `norm_tensors`
    are the final norm's stored weight (and a LayerNorm's bias); `norm.weight_offset` says
    what the model adds to the weight (Gemma's 1 + w)."""

    norm: NormSpec
    norm_tensors: tuple[Tensor, ...]
    head: nn.Module  # the output head (a linear layer of any kind the runtime prepared)
    softcap: float | None = None  # logits become cap * tanh(logits / cap) (Gemma 2)


class CausalDecoder(nn.Module, metaclass=ABCMeta):
    """What the decoders share; subclasses list their attention layers and give the two
    ends of their forward (`embed`, `head`).

    `eos_token_ids` are the tokens that end a generation (from the checkpoint's config;
    empty when unknown).
    """

    eos_token_ids: tuple[int, ...] = ()
    # True when the loader read the layer weights from 4-bit blocks (a Q4_0/Q4_1 GGUF file):
    # the default decode precision is then int4 (qkv.names).
    stored_in_four_bits: bool = False

    @abstractmethod
    def attention_layers(self) -> Iterator[nn.Module]:
        """Every attention layer, in order; each has `cache_spec()` and takes `cache=`."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """The most positions the model can attend over."""

    @abstractmethod
    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """input_ids (B, T) at positions (T,) or (B, T) -> the first layer's input (B, T, C)."""

    @abstractmethod
    def head(self, x: Tensor) -> Tensor:
        """The last layer's output (B, T, C) -> logits (B, T, V): final norm, output head."""

    def layer_specs(self) -> tuple[LayerSpec, ...] | None:
        """Each layer's description (qkv.models.configs.layer_spec), for a runtime that executes
        descriptions (qkv.runtime's native layer step), or None when the family gives none."""
        return None

    def layer_parts(self) -> list[LayerParts] | None:
        """The layers as `LayerParts`, or None when this family's layers cannot be told so."""
        return None

    def head_parts(self) -> HeadParts | None:
        """The final norm and output head as `HeadParts`, or None when `head` is not only those."""
        return None

    def rotary_embedding(self) -> RotaryEmbedding | None:
        """The model's RoPE, handed to caches that rotate keys themselves (None: no RoPE)."""
        return None

    def streams_past_context(self, kind: CacheKind) -> bool:
        """Whether caches of `kind` let this model run past its context length: a kind that
        evicts old tokens (`streams`) on a model with RoPE, where the cache re-numbers the
        positions it rotates by. Learned absolute positions (GPT-2) cannot be re-numbered."""
        cls = getattr(kind, "func", kind)  # a kind is a class or a functools.partial of one
        return bool(getattr(cls, "streams", False)) and self.rotary_embedding() is not None

    def cache_specs(self, batch_size: int, capacity: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> list[CacheSpec]:
        """What each attention layer's KV cache holds, for `capacity` positions of
        `batch_size` rows (dtype and device default to the model's)."""
        if capacity > self.context_length:
            raise ValueError(
                f"a cache of {capacity} tokens exceeds the model's context length "
                f"({self.context_length})"
            )
        reference = next(self.parameters())
        dtype = reference.dtype if dtype is None else dtype
        device = reference.device if device is None else torch.device(device)
        rotary = self.rotary_embedding()
        return [layer.cache_spec(batch_size, capacity, dtype=dtype, device=device, layer_index=index, rotary=rotary)
                for index, layer in enumerate(self.attention_layers())]

    def rope_positions(self, positions: Tensor, caches: Sequence[KVCache] | None) -> Tensor:
        """The positions RoPE rotates the new tokens by (the caches' say; see KVCache)."""
        return caches[0].rope_positions(positions) if caches else positions

    def position_limit(self, caches: Sequence[KVCache] | None) -> int:
        """One past the furthest true position a call may reach with these caches."""
        if not caches:
            return self.context_length
        if all(cache.rotates_keys for cache in caches):  # rotation stays inside the caches: no context limit
            return min(cache.max_position for cache in caches)
        return min(self.context_length, *(cache.max_position for cache in caches))

    def call_arguments(
        self, input_ids: Tensor, positions: Tensor | None, mask: Tensor | None,
        caches: Sequence[KVCache] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """What every decoder's forward starts with: checked ids and caches, the positions
        of the new tokens (`positions_for`) and the mask as booleans (`key_mask`)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        if caches is not None and len(caches) != sum(1 for _ in self.attention_layers()):
            raise ValueError(f"caches must give one KV cache per attention layer "
                             f"({sum(1 for _ in self.attention_layers())}), got {len(caches)}")
        return self.positions_for(input_ids, positions, caches), key_mask(mask)

    def positions_for(self, input_ids: Tensor, positions: Tensor | None,
                      caches: Sequence[KVCache] | None = None) -> Tensor:
        """The positions of the new tokens, (T,) or (B, T): the given ones, or those that
        follow the cached tokens. Checks them against the context length and the caches'
        capacity (one small read of a tensor per call, outside any compiled region)."""
        t = input_ids.shape[1]
        cache = caches[0] if caches else None
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + t, device=input_ids.device)  # (T,)
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
        limit = self.position_limit(caches)
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
