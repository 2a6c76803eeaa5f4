"""The interface every qkv decoder shares, so generation, tracing and benchmarks need not
know which family they drive.

    model(input_ids (B, T), *, positions=None, mask=None) -> logits (B, T, V)
    model.setup_cache(batch_size, max_seq_len, *, dtype=None, device=None)
    model.reset_cache(); model.remove_cache(); model.cache_length(); model.context_length

`positions` (T,) or (B, T) are absolute token positions; by default cache_length() +
arange(T). `mask` is either a (B, S) key padding mask (True/1 = real token, S = cached +
new tokens) or a boolean mask broadcastable to (B, 1, T, S). Causality is always applied
by the kernel, so a plain batch needs no mask at all.

Every attention layer keeps its KV cache as a submodule named `kv_cache`.

Shape legend: B batch, T new tokens, S key tokens (cache included), V vocabulary.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from qkv.attention.kv_cache import KVCache


def key_mask(mask: Tensor | None) -> Tensor | None:
    """A (B, S) key padding mask becomes (B, 1, 1, S) booleans; other masks pass unchanged."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    return mask


class CausalDecoder(nn.Module, metaclass=ABCMeta):
    """Cache management shared by the decoders; subclasses list their attention layers.

    `eos_token_ids` are the tokens that end a generation (from the checkpoint's config;
    empty when unknown).
    """

    eos_token_ids: tuple[int, ...] = ()

    @abstractmethod
    def attention_layers(self) -> Iterator[nn.Module]:
        """Every attention layer, in order; each has `setup_cache()` and `kv_cache`."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """The most positions the model can attend over."""

    def setup_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Attach an empty (B, H_kv, max_seq_len, D) KV cache to every attention layer."""
        if max_seq_len > self.context_length:
            raise ValueError(
                f"a cache of {max_seq_len} tokens exceeds the model's context length "
                f"({self.context_length})"
            )
        reference = next(self.parameters())
        dtype = reference.dtype if dtype is None else dtype
        device = reference.device if device is None else torch.device(device)
        for layer in self.attention_layers():
            layer.setup_cache(batch_size, max_seq_len, dtype=dtype, device=device)

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

    def cache_length(self) -> int:
        """How many tokens the attached caches hold (0 without caches)."""
        caches = self.caches()
        return caches[0].length if caches else 0

    def cache_nbytes(self) -> int:
        """Bytes held by all attached KV caches."""
        return sum(cache.nbytes for cache in self.caches())

    def default_positions(self, input_ids: Tensor) -> Tensor:
        """(T,) positions following the cached tokens; checks the context length."""
        start, t = self.cache_length(), input_ids.shape[1]
        if start + t > self.context_length:
            raise ValueError(
                f"{start + t} tokens exceed the model's context length ({self.context_length}); "
                "shorten the input"
            )
        return torch.arange(start, start + t, device=input_ids.device)  # (T,)
