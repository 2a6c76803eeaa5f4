"""A quantized KV cache (KIVI-style): keys per channel, values per token, the newest tokens
and the first ones kept in the model's precision.

    kind = QuantizedKVCache.kind(bits=4, group_size=64, residual=64, sinks=0)
    model.setup_cache(batch, capacity, kind=kind)

Keys have a few channels of persistently large magnitude, so a key is quantized per
channel: the statistics (min, max) of each channel run over a group of `group_size`
consecutive tokens. Values have no such channels and are quantized per token, over groups
of `channel_group` channels. A group is quantized only once it is complete and all its
tokens are older than the `residual` newest ones, which stay in full precision (so a
prompt is never quantized before it has a residual window); the first `sinks` tokens stay
exact (KVQuant's attention-sink tokens). Codes are stored packed (2 per byte at 4 bits,
4 per byte at 2 bits); scales and zero points are stored in the model's dtype and counted
in `nbytes`: with groups of 64 (tokens for keys, channels for values) and 16-bit
statistics they add half a bit per number, so a bfloat16 cache shrinks 16 / 4.5 = 3.6x at
4 bits and 16 / 2.5 = 6.4x at 2 bits, less the full-precision tail. `key_axis="token"` quantizes keys per token like values: the ablation that
shows why keys want per-channel statistics.

Keys are quantized after RoPE (the attention layer hands the cache rotated keys; the
layer's interface is left as it is). KVQuant quantizes keys before RoPE, where the outlier
channels are steadier; post-RoPE per-channel quantization over short groups works because
a group spans few rotation steps of the low-frequency (large) channels.

`update` attends over what it answers: the dequantized keys and values of every held
position (S = length after the write) and the causal mask for them. It reads the cache's
length into Python once per call (positions must continue the cached ones), so unlike
`StaticKVCache` its shapes grow with the length: correctness first, not one compiled graph
(a compiled decode step runs `update` eagerly, `torch.compiler.disable`).

Shape legend: B batch, H_kv key/value heads, T new tokens, S positions held, D head size of
keys, D_v of values, G group size (tokens), N_g groups, C channel groups of a token.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from qkv.attention.kv_cache import CacheKind, CacheSpec, KVCache, visible_keys
from qkv.attention.quantize import check_bits, dequantize, pack, quantize, unpack

KEY_AXES = ("channel", "token")


class QuantizedKVCache(KVCache):
    """Packed integer codes for old tokens; the newest `residual` (+ an incomplete group)
    and the first `sinks` tokens in full precision."""

    def __init__(self, spec: CacheSpec, *, bits: int = 4, group_size: int = 64, residual: int = 64,
                 sinks: int = 0, channel_group: int = 64, key_axis: str = "channel") -> None:
        super().__init__(spec)
        s = spec
        self.bits = check_bits(bits)
        if group_size < 1 or residual < 0 or sinks < 0:
            raise ValueError(f"group_size must be >= 1, residual and sinks >= 0, got "
                             f"{group_size}, {residual}, {sinks}")
        if key_axis not in KEY_AXES:
            raise ValueError(f"key_axis must be one of {KEY_AXES}, got {key_axis!r}")
        per = 8 // bits
        channel_group = min(channel_group, s.head_dim, s.value_dim)
        for name, dim in (("head_dim", s.head_dim), ("value_dim", s.value_dim)):
            if dim % channel_group or dim % per:
                raise ValueError(f"{name} {dim} is not a multiple of the channel group {channel_group} "
                                 f"and of {per} codes per byte")
        self.group_size, self.residual, self.sinks = group_size, residual, min(sinks, s.capacity)
        self.channel_group, self.key_axis = channel_group, key_axis
        groups = math.ceil(max(s.capacity - self.sinks, 0) / group_size)  # N_g
        slots = groups * group_size
        b, h, d, dv = s.batch_size, s.num_kv_heads, s.head_dim, s.value_dim
        fp = {"dtype": s.dtype, "device": s.device}
        u8 = {"dtype": torch.uint8, "device": s.device}

        def buffer(name: str, *shape: int, **kw: object) -> None:
            self.register_buffer(name, torch.zeros(*shape, **kw), persistent=False)  # type: ignore[arg-type]

        buffer("sink_k", b, h, self.sinks, d, **fp)
        buffer("sink_v", b, h, self.sinks, dv, **fp)
        buffer("pending_k", b, h, residual + group_size, d, **fp)
        buffer("pending_v", b, h, residual + group_size, dv, **fp)
        buffer("k_codes", b, h, slots, d // per, **u8)
        buffer("v_codes", b, h, slots, dv // per, **u8)
        key_stats = (b, h, groups, d) if key_axis == "channel" else (b, h, slots, d // channel_group)
        buffer("k_scale", *key_stats, **fp)
        buffer("k_zero", *key_stats, **fp)
        buffer("v_scale", b, h, slots, dv // channel_group, **fp)
        buffer("v_zero", b, h, slots, dv // channel_group, **fp)
        self._held = 0  # positions held
        self._quantized = self.sinks  # positions below this are sinks or quantized

    @classmethod
    def kind(cls, **options: object) -> CacheKind:
        """A cache kind (CacheSpec -> cache) with these options."""
        return functools.partial(cls, **options)  # type: ignore[arg-type]

    # -- quantization of whole groups ---------------------------------------------------
    def _per_token(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H_kv, n, D) -> codes (B, H_kv, n, D), scale/zero (B, H_kv, n, C)."""
        b, h, n, d = x.shape
        grouped = x.reshape(b, h, n, d // self.channel_group, self.channel_group)  # (B, H_kv, n, C, D/C)
        codes, scale, zero = quantize(grouped, self.bits, dim=-1)
        return codes.reshape(b, h, n, d), scale.squeeze(-1), zero.squeeze(-1)

    def _store(self, k: Tensor, v: Tensor) -> None:
        """Quantize whole groups of tokens (B, H_kv, m * G, D) at the next free groups."""
        g = self.group_size
        start = self._quantized - self.sinks  # first slot
        n = k.shape[2]
        b, h, _, d = k.shape
        if self.key_axis == "channel":
            grouped = k.reshape(b, h, n // g, g, d)  # (B, H_kv, m, G, D)
            codes, scale, zero = quantize(grouped, self.bits, dim=3)  # stats (B, H_kv, m, 1, D)
            self.k_scale[:, :, start // g:(start + n) // g] = scale.squeeze(3)
            self.k_zero[:, :, start // g:(start + n) // g] = zero.squeeze(3)
            codes = codes.reshape(b, h, n, d)
        else:
            codes, scale, zero = self._per_token(k)
            self.k_scale[:, :, start:start + n] = scale
            self.k_zero[:, :, start:start + n] = zero
        self.k_codes[:, :, start:start + n] = pack(codes, self.bits)
        codes, scale, zero = self._per_token(v)
        self.v_codes[:, :, start:start + n] = pack(codes, self.bits)
        self.v_scale[:, :, start:start + n] = scale
        self.v_zero[:, :, start:start + n] = zero
        self._quantized += n

    def _dequantized(self) -> tuple[Tensor, Tensor]:
        """The quantized positions, back in the model's dtype: (B, H_kv, q, D)."""
        n = self._quantized - self.sinks
        g, c = self.group_size, self.channel_group
        codes = unpack(self.k_codes[:, :, :n], self.bits)  # (B, H_kv, n, D)
        b, h, _, d = codes.shape
        if self.key_axis == "channel":
            grouped = codes.reshape(b, h, n // g, g, d)  # (B, H_kv, m, G, D)
            k = dequantize(grouped, self.k_scale[:, :, :n // g, None], self.k_zero[:, :, :n // g, None])
            k = k.reshape(b, h, n, d)
        else:
            grouped = codes.reshape(b, h, n, d // c, c)  # (B, H_kv, n, C, D/C)
            k = dequantize(grouped, self.k_scale[:, :, :n, :, None], self.k_zero[:, :, :n, :, None])
            k = k.reshape(b, h, n, d)
        vcodes = unpack(self.v_codes[:, :, :n], self.bits)  # (B, H_kv, n, D_v)
        dv = vcodes.shape[-1]
        grouped = vcodes.reshape(b, h, n, dv // c, c)  # (B, H_kv, n, C, D_v/C)
        v = dequantize(grouped, self.v_scale[:, :, :n, :, None], self.v_zero[:, :, :n, :, None])
        return k, v.reshape(b, h, n, dv)

    # -- the interface ------------------------------------------------------------------
    @torch.compiler.disable  # reads its length into Python: runs eagerly inside a compiled step
    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.check_input(k, v, positions)
        if positions.dim() != 1:
            raise ValueError("a quantized KV cache takes positions shared by every row, shape (T,)")
        t = k.shape[2]
        start = int(positions[0])
        if start != self._held and not self._quantized <= start <= self._held:
            raise ValueError(f"a quantized KV cache continues at position {self._held} "
                             f"(or rewinds into its full-precision tail), got {start}")
        if start + t > self.capacity:
            raise ValueError(f"{start + t} positions exceed this KV cache's capacity ({self.capacity})")
        k, v = k.to(self.spec.dtype), v.to(self.spec.dtype)
        self._held = start
        sink_part = max(0, min(t, self.sinks - start))  # new tokens that are sinks
        if sink_part:
            self.sink_k[:, :, start:start + sink_part] = k[:, :, :sink_part]
            self.sink_v[:, :, start:start + sink_part] = v[:, :, :sink_part]
        tail = self._held - self._quantized if self._held > self._quantized else 0
        fresh_k = torch.cat([self.pending_k[:, :, :tail], k[:, :, sink_part:]], dim=2)  # (B, H_kv, n, D)
        fresh_v = torch.cat([self.pending_v[:, :, :tail], v[:, :, sink_part:]], dim=2)
        n = fresh_k.shape[2]
        done = max(0, (n - self.residual) // self.group_size) * self.group_size  # tokens to quantize
        if done:
            self._store(fresh_k[:, :, :done], fresh_v[:, :, :done])
        left = n - done
        self.pending_k[:, :, :left] = fresh_k[:, :, done:]
        self.pending_v[:, :, :left] = fresh_v[:, :, done:]
        self._held = start + t
        keys, values = self._read()
        held = torch.arange(self._held, device=positions.device)  # (S,)
        return keys, values, visible_keys(held, positions)

    def _read(self) -> tuple[Tensor, Tensor]:
        """Every held position in order: sinks, dequantized groups, the full-precision tail."""
        qk, qv = self._dequantized()
        tail = self._held - self._quantized
        sinks = min(self.sinks, self._held)
        keys = torch.cat([self.sink_k[:, :, :sinks], qk, self.pending_k[:, :, :tail]], dim=2)  # (B, H_kv, S, D)
        values = torch.cat([self.sink_v[:, :, :sinks], qv, self.pending_v[:, :, :tail]], dim=2)
        return keys, values

    def reset(self) -> None:
        self._held, self._quantized = 0, self.sinks

    def truncate(self, length: int) -> None:
        if length < self._quantized and length < self._held:
            raise NotImplementedError(
                f"this quantized KV cache cannot rewind below position {self._quantized} "
                "(older tokens are quantized); reset it instead")
        self._held = min(self._held, length)

    def contents(self) -> tuple[Tensor, Tensor]:
        return self._read()

    @property
    def length(self) -> int:
        return self._held

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    def extra_repr(self) -> str:
        return (f"bits={self.bits}, group_size={self.group_size}, residual={self.residual}, "
                f"sinks={self.sinks}, keys per {self.key_axis}, capacity={self.capacity}")
