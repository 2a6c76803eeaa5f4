"""A quantized KV cache (KIVI-style): keys per channel, values per token, the newest tokens
and the first ones kept in the model's precision.

    kind = QuantizedKVCache.kind(bits=4, group_size=64, residual=64, sinks=0, rope="before")
    DecodeSession(model, batch_size=batch, capacity=capacity, kind=kind)  # qkv.runtime

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
4 bits and 16 / 2.5 = 6.4x at 2 bits, less the full-precision tail. `key_axis="token"`
quantizes keys per token like values: the ablation that shows why keys want per-channel
statistics.

Keys are quantized before RoPE (KVQuant's choice), on models with RoPE: the layer hands
them over unrotated (`rotates_keys`), and the cache rotates the dequantized keys at their
true positions when it reads them. Measured on SmolLM2 (2048 tokens of the-verdict,
benchmarks/RESULTS.md), int2 loses +17.6% perplexity before RoPE against +21.3% after it,
int4 +0.29% against +0.33%: before RoPE each channel keeps one distribution, where after
it a channel pair rotates through its range within a group. rope="after" quantizes the
rotated keys as the layer would hand them over (the comparison); so does a model without
RoPE.

Layout and shapes. The answer of `update` always has the same layout, whatever the length:
[sinks | every group slot of the capacity, dequantized | the full-precision tail], with
the mask (derived from the positions each slot holds) hiding what is not filled. A
one-token call (a decode step) updates the cache with tensor operations only (whether a
group is full is a tensor, and the group is written through `torch.where`), so it has one
shape at every length and compiles to one graph; a longer call (a prompt, run eagerly)
reads the cache's counters into Python once.

A decode step is attended by the cache itself (`decode_attention`: write, then `attend`),
so attention never reads these buffers: qkv's kernel (qkv.runtime.native, csrc/quantized_cache/attention.cpp)
reads the packed codes, dequantizes them in registers, rotates the keys at their positions
from RoPE tables shared by every layer, and reads the keys of a KV head once for all the
query heads that share them. Where the kernel is not loaded, `reference_attention` computes
the same numbers (to float rounding) from a dequantized copy, as two float32 reductions.

Shape legend: B batch, H_kv key/value heads, T new tokens, S positions answered (sinks +
group slots + tail), D head size of keys, D_v of values, G group size (tokens), N_g groups,
C channel groups of a token, P tail slots (residual + G).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import Tensor

from qkv.attention.kernels import reduction_attention
from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, KVCache
from qkv.attention.caches.quantize import check_bits, dequantize, pack, quantize, unpack
from qkv.attention.rope import apply_rope
from qkv.attention.registry import ATTENTION_FUNCTIONS

KEY_AXES = ("channel", "token")
ROPE_SIDES = ("after", "before")  # quantize keys after RoPE (as the layer hands them) or before


class QuantizedKVCache(KVCache):
    """Packed integer codes for old tokens; the newest `residual` (+ an incomplete group)
    and the first `sinks` tokens in full precision."""

    def __init__(self, spec: CacheSpec, *, bits: int = 4, group_size: int = 64, residual: int = 64,
                 sinks: int = 0, channel_group: int = 64, key_axis: str = "channel",
                 rope: str = "before") -> None:
        super().__init__(spec)
        if rope not in ROPE_SIDES:
            raise ValueError(f"rope must be one of {ROPE_SIDES}, got {rope!r}")
        self.rope = rope
        s = spec
        self.bits = check_bits(bits)
        if group_size < 1 or residual < 0 or sinks < 0:
            raise ValueError(f"group_size must be >= 1, residual and sinks >= 0, got "
                             f"{group_size}, {residual}, {sinks}")
        if key_axis not in KEY_AXES:
            raise ValueError(f"key_axis must be one of {KEY_AXES}, got {key_axis!r}")
        if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"a quantized KV cache holds float32, bfloat16 or float16 keys, not {s.dtype}")
        per = 8 // bits
        # The largest channel group up to the one asked for that divides both head sizes.
        channel_group = max(c for c in range(1, min(channel_group, s.head_dim, s.value_dim) + 1)
                            if s.head_dim % c == 0 and s.value_dim % c == 0)
        for name, dim in (("head_dim", s.head_dim), ("value_dim", s.value_dim)):
            if dim % per:
                raise ValueError(f"a head size of {dim} ({name}) does not pack into bytes of {per} "
                                 f"{bits}-bit codes; use --kv-cache int4 or full")
        self.group_size, self.residual, self.sinks = group_size, residual, min(sinks, s.capacity)
        self.channel_group, self.key_axis = channel_group, key_axis
        self.groups = math.ceil(max(s.capacity - self.sinks, 0) / group_size)  # N_g
        self.slots = self.groups * group_size
        self.tail = residual + group_size  # P
        b, h, d, dv = s.batch_size, s.num_kv_heads, s.head_dim, s.value_dim
        fp = {"dtype": s.dtype, "device": s.device}
        u8 = {"dtype": torch.uint8, "device": s.device}

        def buffer(name: str, *shape: int, **kw: object) -> None:
            self.register_buffer(name, torch.zeros(*shape, **kw), persistent=False)  # type: ignore[arg-type]

        buffer("sink_k", b, h, self.sinks, d, **fp)
        buffer("sink_v", b, h, self.sinks, dv, **fp)
        buffer("pending_k", b, h, self.tail, d, **fp)
        buffer("pending_v", b, h, self.tail, dv, **fp)
        buffer("k_codes", b, h, self.slots, d // per, **u8)
        buffer("v_codes", b, h, self.slots, dv // per, **u8)
        key_stats = (b, h, self.groups, d) if key_axis == "channel" else (b, h, self.slots, d // channel_group)
        buffer("k_scale", *key_stats, **fp)
        buffer("k_zero", *key_stats, **fp)
        buffer("v_scale", b, h, self.slots, dv // channel_group, **fp)
        buffer("v_zero", b, h, self.slots, dv // channel_group, **fp)
        # Counters as tensors, so a decode step reads nothing into Python.
        long = {"dtype": torch.long, "device": s.device}
        self.register_buffer("held", torch.zeros((), **long), persistent=False)  # positions held
        # Positions below this are sinks or quantized; the tail holds [quantized, held).
        self.register_buffer("quantized", torch.full((), self.sinks, **long), persistent=False)
        self.register_buffer("sink_pos", torch.arange(self.sinks, **long), persistent=False)
        self.register_buffer("slot_pos", torch.arange(self.slots, **long) + self.sinks, persistent=False)
        self.register_buffer("tail_index", torch.arange(self.tail, **long), persistent=False)
        # RoPE at every position, half a head wide, for the native kernel (shared by the layers).
        tables = _half_rope_tables(s) if self.rotates_keys else None
        self.native_rope = tables is not None or not self.rotates_keys
        self.register_buffer("rope_cos", None if tables is None else tables[0], persistent=False)
        self.register_buffer("rope_sin", None if tables is None else tables[1], persistent=False)

    @classmethod
    def kind(cls, **options: object) -> CacheKind:
        """A cache kind (CacheSpec -> cache) with these options."""
        return functools.partial(cls, **options)  # type: ignore[arg-type]

    @property
    def attends_decode_step(self) -> bool:
        return True

    @property
    def rotates_keys(self) -> bool:
        """With rope="before" (and a model with RoPE) keys arrive unrotated, are quantized so,
        and are rotated at their true positions when read."""
        return self.rope == "before" and self.spec.rotary is not None

    # -- quantization of whole groups ---------------------------------------------------
    def _per_token(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H_kv, n, D) -> codes (B, H_kv, n, D), scale/zero (B, H_kv, n, C)."""
        b, h, n, d = x.shape
        grouped = x.reshape(b, h, n, d // self.channel_group, self.channel_group)  # (B, H_kv, n, C, D/C)
        codes, scale, zero = quantize(grouped, self.bits, dim=-1)
        return codes.reshape(b, h, n, d), scale.squeeze(-1), zero.squeeze(-1)

    def _quantized_groups(self, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """Whole groups (B, H_kv, m * G, D) -> packed key codes, key scale, key zero,
        packed value codes, value scale, value zero (key statistics per group or token)."""
        g = self.group_size
        b, h, n, d = k.shape
        if self.key_axis == "channel":
            grouped = k.reshape(b, h, n // g, g, d)  # (B, H_kv, m, G, D)
            codes, k_scale, k_zero = quantize(grouped, self.bits, dim=3)  # stats (B, H_kv, m, 1, D)
            k_codes, k_scale, k_zero = codes.reshape(b, h, n, d), k_scale.squeeze(3), k_zero.squeeze(3)
        else:
            k_codes, k_scale, k_zero = self._per_token(k)
        v_codes, v_scale, v_zero = self._per_token(v)
        return pack(k_codes, self.bits), k_scale, k_zero, pack(v_codes, self.bits), v_scale, v_zero

    def _store(self, k: Tensor, v: Tensor, start: int) -> None:
        """Quantize whole groups (B, H_kv, m * G, D) into the slots from `start` on."""
        n, g = k.shape[2], self.group_size
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = self._quantized_groups(k, v)
        self.k_codes[:, :, start:start + n] = k_codes
        stats = slice(start // g, (start + n) // g) if self.key_axis == "channel" else slice(start, start + n)
        self.k_scale[:, :, stats] = k_scale
        self.k_zero[:, :, stats] = k_zero
        self.v_codes[:, :, start:start + n] = v_codes
        self.v_scale[:, :, start:start + n] = v_scale
        self.v_zero[:, :, start:start + n] = v_zero

    def _dequantized(self, n: int | None = None) -> tuple[Tensor, Tensor]:
        """The first n group slots (default: all, filled or not) back in the model's dtype:
        (B, H_kv, n, D). n is a multiple of the group size."""
        n = self.slots if n is None else n
        g, c = self.group_size, self.channel_group
        codes = unpack(self.k_codes[:, :, :n], self.bits)  # (B, H_kv, n, D)
        b, h, _, d = codes.shape
        if self.key_axis == "channel":
            grouped = codes.reshape(b, h, n // g, g, d)  # (B, H_kv, n/G, G, D)
            k = dequantize(grouped, self.k_scale[:, :, :n // g, None], self.k_zero[:, :, :n // g, None])
        else:
            grouped = codes.reshape(b, h, n, d // c, c)  # (B, H_kv, n, C, D/C)
            k = dequantize(grouped, self.k_scale[:, :, :n, :, None], self.k_zero[:, :, :n, :, None])
        vcodes = unpack(self.v_codes[:, :, :n], self.bits)  # (B, H_kv, n, D_v)
        dv = vcodes.shape[-1]
        grouped = vcodes.reshape(b, h, n, dv // c, c)  # (B, H_kv, n, C, D_v/C)
        v = dequantize(grouped, self.v_scale[:, :, :n, :, None], self.v_zero[:, :, :n, :, None])
        return k.reshape(b, h, n, d), v.reshape(b, h, n, dv)

    # -- the interface ------------------------------------------------------------------
    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.check_input(k, v, positions)
        if positions.dim() != 1:
            raise ValueError("a quantized KV cache takes positions shared by every row, shape (T,)")
        k, v = k.to(self.spec.dtype), v.to(self.spec.dtype)
        if k.shape[2] == 1:
            self._step(k, v, positions[0])
            return self._read(positions)
        filled = self._prompt(k, v, positions)
        return self._read(positions, filled)  # eager: only the group slots in use

    def decode_attention(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                         scale: float | None = None) -> Tensor:
        """One decode step: write the new key and value (B, H_kv, 1, D) at `positions` (1,),
        then attend the queries (B, H, 1, D) over everything held, read from the codes
        (`attend`). -> context (B, H, 1, D_v)."""
        self.check_input(k, v, positions)
        if positions.shape != (1,) or k.shape[2] != 1:
            raise ValueError("a decode step writes one token at one position shared by every row, shape (1,)")
        self._step(k.to(self.spec.dtype), v.to(self.spec.dtype), positions[0])
        return self.attend(q, scale)

    def attend(self, q: Tensor, scale: float | None = None, *, variant: str | None = None) -> Tensor:
        """Queries (B, H, 1, D) at the newest position held, over every held position (sinks,
        groups, tail) -> (B, H, 1, D_v). qkv's kernel reads the packed codes where the runtime
        registered it (qkv.attention.registry's "quantized_decode")
        (`variant`: "best", "generic", "avx2", "avx512"; default "best"); else, or with
        variant="torch", `reference_attention` (the same numbers to float rounding)."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if variant == "torch" or (variant is None and not self._native_fits(q)):
            return self.reference_attention(q, scale)
        b, h, _, d = q.shape
        stored = [getattr(self, name).float() for name in (
            "k_scale", "k_zero", "v_scale", "v_zero", "sink_k", "sink_v", "pending_k", "pending_v")]
        k_scale, k_zero, v_scale, v_zero, sink_k, sink_v, tail_k, tail_v = stored  # float32 (copies if not)
        out = ATTENTION_FUNCTIONS["quantized_decode"](
            q.reshape(b, h, d).float().contiguous(), self.k_codes, k_scale, k_zero, self.v_codes, v_scale, v_zero,
            sink_k, sink_v, tail_k, tail_v, self.held, self.quantized, self.rope_cos, self.rope_sin,
            bits=self.bits, group_size=self.group_size, keys_per_channel=self.key_axis == "channel",
            scale=scale, variant=variant or "best")  # (B, H, D_v)
        return out.unsqueeze(2).to(q.dtype)  # (B, H, 1, D_v)

    def reference_attention(self, q: Tensor, scale: float | None = None) -> Tensor:
        """What `attend` computes, in torch: every group slot dequantized (keys rotated at
        their positions), then attention as two float32 reductions. (B, H, 1, D) -> (B, H, 1, D_v)."""
        keys, values, visible = self._read((self.held - 1)[None])  # the query sits at the newest position
        return reduction_attention(q, keys, values, mask=visible, scale=scale)

    def _native_fits(self, q: Tensor) -> bool:
        return ("quantized_decode" in ATTENTION_FUNCTIONS and self.native_rope and q.device.type == "cpu" and not q.requires_grad
                and q.dim() == 4 and q.shape[2] == 1 and q.shape[0] == self.batch_size)

    def _step(self, k: Tensor, v: Tensor, position: Tensor) -> None:
        """One token at `position` (a tensor: it continues what is held, or rewrites a
        position in the full-precision tail), with tensor operations only."""
        is_sink = position < self.sinks
        if self.sinks:
            at = position.clamp(max=self.sinks - 1)[None]  # (1,)
            self.sink_k.index_copy_(2, at, torch.where(is_sink, k, self.sink_k.index_select(2, at)))
            self.sink_v.index_copy_(2, at, torch.where(is_sink, v, self.sink_v.index_select(2, at)))
        at = (position - self.quantized).clamp(0, self.tail - 1)[None]  # (1,) its tail slot
        self.pending_k.index_copy_(2, at, torch.where(is_sink, self.pending_k.index_select(2, at), k))
        self.pending_v.index_copy_(2, at, torch.where(is_sink, self.pending_v.index_select(2, at), v))
        self.held.copy_(position + 1)
        if not self.groups:
            return
        # The tail is full (residual + a group): quantize its oldest group, shift the rest.
        g = self.group_size
        full = (~is_sink) & (self.held - self.quantized >= self.tail)  # ()
        group = ((self.quantized - self.sinks) // g).clamp(max=self.groups - 1)  # ()
        slots = group * g + self.tail_index[:g]  # (G,)
        new = self._quantized_groups(self.pending_k[:, :, :g], self.pending_v[:, :, :g])
        k_stats = group[None] if self.key_axis == "channel" else slots
        targets = ((self.k_codes, slots), (self.k_scale, k_stats), (self.k_zero, k_stats),
                   (self.v_codes, slots), (self.v_scale, slots), (self.v_zero, slots))
        for (buffer, index), value in zip(targets, new):
            buffer.index_copy_(2, index, torch.where(full, value, buffer.index_select(2, index)))
        for pending in (self.pending_k, self.pending_v):
            pending.copy_(torch.where(full, pending.roll(-g, dims=2), pending))
        self.quantized.add_(full.long() * g)

    def _prompt(self, k: Tensor, v: Tensor, positions: Tensor) -> int:
        """Several tokens (a prompt, run eagerly): the counters are read into Python once.
        Returns how many group slots are filled."""
        held, quantized = int(self.held), int(self.quantized)
        t = k.shape[2]
        start = int(positions[0])
        if start != held and not quantized <= start <= held:
            raise ValueError(f"a quantized KV cache continues at position {held} "
                             f"(or rewinds into its full-precision tail), got {start}")
        if start + t > self.capacity:
            raise ValueError(f"{start + t} positions exceed this KV cache's capacity ({self.capacity})")
        sink_part = max(0, min(t, self.sinks - start))  # new tokens that are sinks
        if sink_part:
            self.sink_k[:, :, start:start + sink_part] = k[:, :, :sink_part]
            self.sink_v[:, :, start:start + sink_part] = v[:, :, :sink_part]
        tail = max(0, start - quantized)
        fresh_k = torch.cat([self.pending_k[:, :, :tail], k[:, :, sink_part:]], dim=2)  # (B, H_kv, n, D)
        fresh_v = torch.cat([self.pending_v[:, :, :tail], v[:, :, sink_part:]], dim=2)
        n = fresh_k.shape[2]
        done = max(0, (n - self.residual) // self.group_size) * self.group_size  # tokens to quantize
        if done:
            self._store(fresh_k[:, :, :done], fresh_v[:, :, :done], quantized - self.sinks)
        left = n - done
        self.pending_k[:, :, :left] = fresh_k[:, :, done:]
        self.pending_v[:, :, :left] = fresh_v[:, :, done:]
        self.held.fill_(start + t)
        self.quantized.fill_(quantized + done)
        return quantized + done - self.sinks

    def _read(self, positions: Tensor, slots: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """[sinks | group slots | tail] and the mask: a slot is visible when it holds a
        position (below `quantized` for sinks and groups, below `held` for the tail) that
        is not after the query's. `slots`: only the first so many group slots (a prompt's
        eager call; by default all, the one layout of a decode step).
        -> (B, H_kv, S, D), (B, H_kv, S, D_v), (1, 1, T, S)."""
        qk, qv = self._dequantized(slots)
        slot_pos = self.slot_pos[: qk.shape[2]]  # (n,)
        keys = torch.cat([self.sink_k, qk, self.pending_k], dim=2)  # (B, H_kv, S, D)
        values = torch.cat([self.sink_v, qv, self.pending_v], dim=2)  # (B, H_kv, S, D_v)
        tail_pos = self.quantized + self.tail_index  # (P,)
        key_pos = torch.cat([self.sink_pos, slot_pos, tail_pos])  # (S,)
        filled = torch.cat([self.sink_pos < self.held, slot_pos < self.quantized, tail_pos < self.held])
        if self.rotates_keys:
            assert self.spec.rotary is not None
            cos, sin = self.spec.rotary(key_pos, dtype=keys.dtype)  # (S, D)
            keys = apply_rope(keys, cos, sin)
        visible = filled[None, :] & (key_pos[None, :] <= positions[:, None])  # (T, S)
        return keys, values, visible[None, None]

    def reset(self) -> None:
        self.held.zero_()
        self.quantized.fill_(self.sinks)

    def truncate(self, length: int) -> None:
        held, quantized = int(self.held), int(self.quantized)
        if length < quantized and length < held:
            raise NotImplementedError(
                f"this quantized KV cache cannot rewind below position {quantized} "
                "(older tokens are quantized); reset it instead")
        self.held.fill_(min(held, length))

    def contents(self) -> tuple[Tensor, Tensor]:
        """Every held position in order: sinks, dequantized groups, the full-precision tail
        (keys unrotated with rope="before")."""
        held, quantized = int(self.held), int(self.quantized)
        sinks = min(self.sinks, held)
        qk, qv = self._dequantized()
        n, tail = max(0, quantized - self.sinks), max(0, held - quantized)
        keys = torch.cat([self.sink_k[:, :, :sinks], qk[:, :, :n], self.pending_k[:, :, :tail]], dim=2)
        values = torch.cat([self.sink_v[:, :, :sinks], qv[:, :, :n], self.pending_v[:, :, :tail]], dim=2)
        return keys, values

    @property
    def length(self) -> int:
        return int(self.held)

    @property
    def nbytes(self) -> int:
        """Bytes of what the cache stores: codes, statistics, full-precision tail and sinks
        (the counters and the position tables it reads its mask from are left out)."""
        stored = ("sink_k", "sink_v", "pending_k", "pending_v", "k_codes", "v_codes",
                  "k_scale", "k_zero", "v_scale", "v_zero")
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in stored)

    def extra_repr(self) -> str:
        return (f"bits={self.bits}, group_size={self.group_size}, residual={self.residual}, "
                f"sinks={self.sinks}, keys per {self.key_axis} {self.rope} RoPE, capacity={self.capacity}")


_ROPE_TABLES: weakref.WeakKeyDictionary[object, dict[tuple[int, str], tuple[Tensor, Tensor]]] = (
    weakref.WeakKeyDictionary())


def _half_rope_tables(spec: CacheSpec) -> tuple[Tensor, Tensor] | None:
    """cos and sin at positions 0 .. capacity - 1, (capacity, D/2) float32, from the model's
    RoPE (computed once per RoPE and capacity, shared by every layer's cache); None when its
    two halves differ (a layout other than rotate-half: the kernel then does not run)."""
    assert spec.rotary is not None
    per_rotary = _ROPE_TABLES.setdefault(spec.rotary, {})
    key = (spec.capacity, str(spec.device))
    if key not in per_rotary:
        cos, sin = spec.rotary(torch.arange(spec.capacity, device=spec.device), dtype=torch.float32)  # (S, D)
        half = cos.shape[-1] // 2
        if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
            return None
        per_rotary[key] = (cos[:, :half].contiguous(), sin[:, :half].contiguous())
    return per_rotary[key]
