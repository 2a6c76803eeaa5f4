"""The decode roofline: bytes read per generated token, and the tokens/s they allow.

At batch 1 a decode step multiplies one row of activations by every weight matrix, so
it does about two floating-point operations per weight it reads: it is bound by memory
bandwidth, not arithmetic. Per token it reads

- every weight of the linear layers (output head included) and of the norms, once;
- one row of each embedding table (unless the table is also the output head, as in
  GPT-2, where it is already counted as a matrix);
- the cached keys and values of every attention layer, S positions each.

Bandwidth / bytes-per-token is then an upper bound on tokens/s. Tensors shared between
modules (tied weights) are counted once. Quantized linears count their int8 or packed int4
weights and their scales, so the bound rises as the bytes fall. (`StaticKVCache` reads its
whole capacity at every step, masked, on the module path; qkv's fused decode layers read
the S visible positions only. Counting S makes the bound that of a step that reads nothing
it masks out.)

Shape legend: S cached positions, H_kv key/value heads, D head size.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class TokenBytes:
    weights: int  # bytes of parameters read per token
    kv_cache: int  # bytes of cached keys and values read per token

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights a one-token forward pass reads (tied tensors once)."""
    seen: set[int] = set()
    total = 0

    def count(t: Tensor | None, nbytes: int | None = None) -> None:
        nonlocal total
        if t is None or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        total += _nbytes(t) if nbytes is None else nbytes

    modules = list(model.modules())
    embeddings = [m for m in modules if isinstance(m, nn.Embedding)]
    # Matrices first, so an embedding tied to the output head is counted as a matrix.
    for module in modules:
        if isinstance(module, nn.Embedding):
            continue
        for tensor in [*module.parameters(recurse=False), *_persistent_buffers(module)]:
            count(tensor)
    for emb in embeddings:
        count(emb.weight, emb.weight.shape[1] * emb.weight.element_size())  # one row
    return total


def _persistent_buffers(module: nn.Module) -> list[Tensor]:
    """Weights kept as buffers (the int8 linear's weight and scales). KV caches and RoPE
    tables are non-persistent buffers: not weights, left out."""
    skip = module._non_persistent_buffers_set
    return [b for name, b in module.named_buffers(recurse=False) if name not in skip]


def kv_bytes_per_token(caches: Sequence[nn.Module], positions: int) -> int:
    """Bytes of cached keys and values read by one decode step over `positions` tokens.

    Read from a session's KV caches (`k_cache` and `v_cache` buffers of shape
    (B, H_kv, S_max, D)).
    """
    total = 0
    for module in caches:
        for buf in (module.k_cache, module.v_cache):
            b, h, _, d = buf.shape
            total += b * h * positions * d * buf.element_size()
    return total


def token_bytes(model: nn.Module, caches: Sequence[nn.Module], positions: int) -> TokenBytes:
    return TokenBytes(weight_bytes_per_token(model), kv_bytes_per_token(caches, positions))


def roofline_tokens_per_s(bytes_per_token: int, gb_per_s: float) -> float:
    """The bandwidth bound: tokens/s if every byte were read at the measured speed."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return gb_per_s * 1e9 / bytes_per_token
