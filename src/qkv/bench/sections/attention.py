"""attention: one causal self-attention forward at the GPT-2-124M width: qkv explicit,
qkv fused, raw scaled_dot_product_attention, nn.MultiheadAttention (which also projects).

Shape legend: B batch (1), H heads, T tokens, D head size, C width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qkv.attention import explicit_attention, fused_attention
from qkv.bench.common import Context, Section
from qkv.bench.measure.timing import alternate, ratio


def repeat(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    def run() -> object:
        for _ in range(calls):
            fn()
        return None

    return run


def attention_section(ctx: Context) -> Section:
    s = ctx.sizes
    section = Section("attention")
    c, h, t = s.n_embd, s.n_head, s.attention_tokens
    d = c // h
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, t, d, generator=gen) for _ in range(3))  # (B, H, T, D)
    x = torch.randn(1, t, c, generator=gen)  # (B, T, C)
    mha = nn.MultiheadAttention(c, h, batch_first=True).eval()
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # (T, T) True = hidden, its convention

    def explicit() -> torch.Tensor:
        return explicit_attention(q, k, v, is_causal=True)[0]

    def fused() -> torch.Tensor:
        return fused_attention(q, k, v, is_causal=True)

    def raw() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def module() -> object:
        return mha(x, x, x, attn_mask=future, need_weights=False)

    with torch.inference_mode():
        section.facts["max |fused - raw SDPA|"] = (fused() - raw()).abs().max().item()
        section.facts["max |explicit - raw SDPA|"] = (explicit() - raw()).abs().max().item()
        calls = max(1, round(2e8 / (h * t * t * d)))  # enough calls per sample to time
        kernels = {"qkv explicit": explicit, "qkv fused": fused, "raw SDPA": raw, "nn.MultiheadAttention": module}
        measured = alternate({name: repeat(fn, calls) for name, fn in kernels.items()},
                             work=calls, unit="calls", repeats=max(ctx.options.repeats, 10))
    section.measurements.extend(measured.values())
    section.ratios.extend(ratio(measured[n], measured["raw SDPA"])
                          for n in ("qkv fused", "qkv explicit", "nn.MultiheadAttention"))
    section.facts["shape (B, H, T, D)"] = [1, h, t, d]
    section.facts["note"] = "nn.MultiheadAttention also runs its input and output projections"
    return section
