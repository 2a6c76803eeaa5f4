"""The anatomy of real keys: per layer and key/value head, what a KV cache has to hold.

    anatomy = key_anatomy(model, input_ids)   # -> KeyAnatomy (to_json() for --json)

For each attention layer and KV head, over the tokens of one text:
- the magnitude of every key channel (mean |k| over tokens), before and after RoPE where
  the model has RoPE, and the ratio of the largest channel to the median one;
- outlier channels (magnitude > OUTLIER_RATIO x the median) and their stability: the share
  of tokens in which each is among that token's largest |k| channels;
- key norms by position (the first token's key is often unlike the rest);
- the sink mass: the mean attention weight the queries (after the first) put on the first
  token, per query head (a local layer's: of the queries whose window still holds it);
- local (sliding-window) layers and global layers summed up apart (`by_attention`): the
  window is read from each attention module's `window` attribute (None: global);
- with RoPE, the magnitude of each rotation pair (in qkv's rotate-half layout channels i and
  i + D/2 rotate together at frequency inv_freq[i]; `rope_partner` computes the pairing for a
  head size and layout) against its wavelength: the large channels sit in the slow bands, and
  two outlier channels D/2 apart are one pair;
- the same channel statistics for values, so the asymmetry shows.
Models without RoPE (GPT-2: learned absolute position embeddings added to the input) get
every statistic but the pre/post-RoPE split and the frequency bands, and say so.

Everything is recomputed from the modules' own parts by the trace adapters (pre-RoPE keys
from k_proj and k_norm), through forward hooks: no model code is changed.

Shape legend: T tokens, H query heads, H_kv key/value heads, D head size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from qkv.attention.rope import RotaryEmbedding
from qkv.attention.caches.window_cache import sliding_window_mask
from qkv.trace.record.adapters import AttentionCall, explain_call
from qkv.trace.record.recorder import attention_modules

OUTLIER_RATIO = 4.0
ROPE_LAYOUTS = ("rotate-half", "interleaved")  # Hugging Face / qkv; Meta's complex pairs


def rope_partner(channel: int, head_dim: int, layout: str = "rotate-half") -> tuple[int, int]:
    """(pair index, the other channel) of `channel` in a head of `head_dim` channels: in the
    rotate-half layout channel i turns with i + D/2 (pair i mod D/2, frequency inv_freq[i]);
    interleaved (Meta's original Llama), channels 2j and 2j + 1 are pair j."""
    if head_dim < 2 or head_dim % 2 or not 0 <= channel < head_dim:
        raise ValueError(f"channel {channel} of a head of {head_dim} channels has no RoPE pair "
                         "(the head size must be even and the channel in range)")
    if layout == "rotate-half":
        half = head_dim // 2
        return channel % half, (channel + half) % head_dim
    if layout == "interleaved":
        return channel // 2, channel ^ 1
    raise ValueError(f"unknown RoPE layout {layout!r}: one of {', '.join(ROPE_LAYOUTS)}")


@dataclass
class ChannelStats:
    magnitude: list[float]  # (D,) mean |x| per channel
    max_over_median: float
    outliers: list[int]  # channels above OUTLIER_RATIO x the median
    stability: list[float]  # per outlier: share of tokens where it is among the top channels


@dataclass
class HeadAnatomy:
    layer: int
    kv_head: int
    keys: ChannelStats  # as compared with queries (post-RoPE when the model has RoPE)
    keys_pre_rope: ChannelStats | None
    values: ChannelStats
    key_norms: list[float]  # (T,) |k| by position
    sink_mass: list[float]  # per query head of this group: mean weight on the first token
    band_magnitude: list[float] | None  # (D/2,) RMS of each rotation pair, pre-RoPE
    window: int | None = None  # a local layer's sliding window; None: a global layer


@dataclass
class KeyAnatomy:
    model: str
    tokens: int
    rope: bool
    wavelengths: list[float] | None  # (D/2,) 2*pi / inv_freq per rotation pair
    head_dim: int = 0
    rope_layout: str | None = None  # how channels pair up under RoPE (None: no RoPE)
    heads: list[HeadAnatomy] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def channel_stats(x: Tensor) -> ChannelStats:
    """x (T, D) -> the channel statistics of one head."""
    mag = x.abs().mean(dim=0)  # (D,)
    median = float(mag.median().clamp_min(1e-12))
    outliers = [int(i) for i in (mag > OUTLIER_RATIO * median).nonzero().flatten()]
    count = max(len(outliers), 1)
    top = x.abs().topk(min(count, x.shape[1]), dim=1).indices  # (T, count)
    stability = [float((top == i).any(dim=1).float().mean()) for i in outliers]
    return ChannelStats([round(float(m), 5) for m in mag], round(float(mag.max()) / median, 3),
                        outliers, [round(s, 3) for s in stability])


def _sink_mass(call: AttentionCall, kv_head: int, window: int | None) -> list[float]:
    """Per query head of the group: the mean weight on the first token of the queries after
    the first that can see it (a local layer's queries past its window cannot: they put
    exactly 0 there, and are left out; with a window of 1 none is left, and the mass is 0)."""
    heads, kv_heads = call.q.shape[1], call.keys.shape[1]
    group = heads // kv_heads
    out = []
    for h in range(kv_head * group, (kv_head + 1) * group):
        q, k = call.q[0, h].float(), call.keys[0, kv_head].float()  # (T, D), (S, D)
        scores = (q @ k.T) * call.scale  # (T, S)
        softcap = getattr(call, "softcap", None)  # Gemma 2's cap, where the adapter records one
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        t, s = scores.shape
        visible = torch.ones(t, s, dtype=torch.bool).tril(s - t)
        if window is not None:
            visible &= sliding_window_mask(t, s, window)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # (T, S)
        seeing = visible[1:, 0]  # (T - 1,) the later queries that see the first token
        if t == 1:
            out.append(1.0)
        else:
            out.append(round(float(weights[1:, 0][seeing].mean()) if bool(seeing.any()) else 0.0, 4))
    return out


def _rotary(model: nn.Module) -> RotaryEmbedding | None:
    return next((m for m in model.modules() if isinstance(m, RotaryEmbedding)), None)


@torch.no_grad()
def key_anatomy(model: nn.Module, input_ids: Tensor, name: str = "") -> KeyAnatomy:
    """Run `input_ids` (1, T) through `model` once and measure every layer's keys."""
    calls: list[AttentionCall] = []
    windows: list[int | None] = []  # each call's layer: its sliding window, or None (global)

    def record(module: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> None:
        calls.append(explain_call(module, args, kwargs))
        windows.append(getattr(module, "window", None))

    handles = [module.register_forward_hook(record, with_kwargs=True) for _, module in attention_modules(model)]
    try:
        model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    rotary = _rotary(model)
    rope = rotary is not None and calls and calls[0].cos is not None
    wavelengths = [round(2 * math.pi / float(f), 2) for f in rotary.inv_freq] if rope else None
    head_dim = int(calls[0].k_new.shape[-1]) if calls else 0
    # qkv's RotaryEmbedding and apply_rope are rotate-half (Hugging Face's layout).
    anatomy = KeyAnatomy(name, int(input_ids.shape[1]), bool(rope), wavelengths, head_dim,
                         "rotate-half" if rope else None)
    for layer, (call, window) in enumerate(zip(calls, windows)):
        for h in range(call.keys.shape[1]):
            k = call.k_new[0, h].float()  # (T, D)
            pre = call.k_unrotated[0, h].float()  # (T, D)
            half = pre.shape[1] // 2
            bands = ((pre[:, :half] ** 2 + pre[:, half:] ** 2) / 2).mean(0).sqrt() if rope else None  # (D/2,)
            anatomy.heads.append(HeadAnatomy(
                layer=layer, kv_head=h, keys=channel_stats(k),
                keys_pre_rope=channel_stats(pre) if rope else None,
                values=channel_stats(call.values[0, h, -k.shape[0]:].float()),
                key_norms=[round(float(n), 4) for n in k.norm(dim=1)],
                sink_mass=_sink_mass(call, h, window),
                band_magnitude=[round(float(b), 5) for b in bands] if bands is not None else None,
                window=window,
            ))
    return anatomy


def outlier_pairs(anatomy: KeyAnatomy, channels: list[int]) -> list[list[int]]:
    """The RoPE pairs among `channels` whose two channels are both listed, as [a, b], a < b."""
    if not anatomy.rope_layout:
        return []
    listed = set(channels)
    pairs = {tuple(sorted((c, rope_partner(c, anatomy.head_dim, anatomy.rope_layout)[1])))
             for c in channels}
    return [list(p) for p in sorted(pairs) if p[0] in listed and p[1] in listed]


def outliers_by_pair(anatomy: KeyAnatomy) -> list[dict[str, object]]:
    """Per RoPE pair: its channels, and in how many (layer, KV head)s either is a key outlier
    channel, most often first. The bright stripes of the channel figure, pair by pair."""
    if not anatomy.rope_layout:
        return []
    counts: dict[int, int] = {}
    for head in anatomy.heads:
        for pair in {rope_partner(c, anatomy.head_dim, anatomy.rope_layout)[0] for c in head.keys.outliers}:
            counts[pair] = counts.get(pair, 0) + 1
    half = anatomy.head_dim // 2
    result = []
    for pair, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        a = pair if anatomy.rope_layout == "rotate-half" else 2 * pair
        result.append({"pair": pair, "channels": [a, a + half if anatomy.rope_layout == "rotate-half" else a + 1],
                       "heads": count})
    return result


def summary_rows(anatomy: KeyAnatomy) -> list[dict[str, object]]:
    """One row per layer and KV head: the numbers a terminal table shows."""
    rows = []
    for head in anatomy.heads:
        norms = head.key_norms
        rest = sorted(norms[1:]) or norms
        rows.append({
            "layer": head.layer, "kv_head": head.kv_head,
            "key_ratio": head.keys.max_over_median,
            "key_ratio_pre_rope": head.keys_pre_rope.max_over_median if head.keys_pre_rope else None,
            "key_outliers": head.keys.outliers, "stability": head.keys.stability,
            "key_outlier_pairs": outlier_pairs(anatomy, head.keys.outliers),
            "value_ratio": head.values.max_over_median, "value_outliers": head.values.outliers,
            "first_key_norm_over_median": round(norms[0] / max(rest[len(rest) // 2], 1e-12), 3),
            "sink_mass": round(sum(head.sink_mass) / len(head.sink_mass), 4),
            "attention": attention_kind(head.window), "window": head.window,
        })
    return rows


def attention_kind(window: int | None) -> str:
    return "global" if window is None else "local"


def by_attention(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """The summary's means over global layers and over local (sliding-window) layers apart:
    a local layer's queries never see far back, so its sink and its keys can differ."""
    kinds: dict[str, dict[str, object]] = {}
    for kind in ("global", "local"):
        chosen = [r for r in rows if r["attention"] == kind]
        if not chosen:
            continue

        def mean(key: str) -> float:
            return round(sum(float(r[key]) for r in chosen) / len(chosen), 4)  # type: ignore[arg-type]

        kinds[kind] = {
            "layers": sorted({int(r["layer"]) for r in chosen}),  # type: ignore[call-overload]
            "windows": sorted({int(r["window"]) for r in chosen if r["window"] is not None}),  # type: ignore[call-overload]
            "heads": len(chosen), "key_ratio": mean("key_ratio"), "value_ratio": mean("value_ratio"),
            "first_key_norm_over_median": mean("first_key_norm_over_median"), "sink_mass": mean("sink_mass"),
        }
    return kinds
