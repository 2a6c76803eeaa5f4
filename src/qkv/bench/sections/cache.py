"""cache: new tokens with and without the KV cache (a small GPT: without the cache each
step reruns the whole prefix); kv_bytes: the cache bytes of multi-head, grouped-query and
multi-query configs of the GPT-2-124M width, from real caches.

Shape legend: B batch (1), T prompt tokens, N new tokens.
"""

from __future__ import annotations

import torch

from qkv.attention import GroupedQueryAttention
from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.bench.common import Context, Section
from qkv.bench.gpt2_checkpoint import load_qkv, make_gpt2_checkpoint, qkv_generate
from qkv.bench.measure.timing import alternate, ratio


def cache_section(ctx: Context) -> Section:
    s = ctx.sizes
    section = Section("cache")
    n_layer, n_embd, n_head, vocab = s.cache_model
    folder = make_gpt2_checkpoint(ctx.folder / "small-gpt2", n_layer, n_embd, n_head, vocab,
                                  s.cache_prompt + s.cache_new, seed=3)
    model = load_qkv(folder)
    ids = torch.randint(1, vocab, (1, s.cache_prompt), generator=torch.Generator().manual_seed(3))  # (B, T)
    cached = qkv_generate(model, ids, s.cache_new)
    uncached = qkv_generate(model, ids, s.cache_new, use_cache=False)
    section.facts["greedy tokens equal with and without cache"] = bool(torch.equal(cached, uncached))
    section.facts["model"] = f"GPT-2 shape, n_layer={n_layer} n_embd={n_embd} n_head={n_head} vocab={vocab}"
    section.facts["prompt tokens"] = s.cache_prompt
    section.facts["new tokens"] = s.cache_new
    measured = alternate(
        {"with cache": lambda: qkv_generate(model, ids, s.cache_new),
         "without cache": lambda: qkv_generate(model, ids, s.cache_new, use_cache=False)},
        work=s.cache_new, unit="tokens", repeats=ctx.options.repeats, warmup=0,
    )
    section.measurements.extend(measured.values())
    section.ratios.append(ratio(measured["with cache"], measured["without cache"]))
    return section


def kv_bytes_section(ctx: Context) -> Section:
    """Real cache sizes: build each config's attention layer and attach a full-length cache."""
    s = ctx.sizes
    section = Section("kv_bytes")
    head_dim = s.n_embd // s.n_head
    for kv_heads in sorted({s.n_head, max(1, s.n_head // 3), 1}, reverse=True):
        layer = GroupedQueryAttention(s.n_embd, s.n_head, num_kv_heads=kv_heads)
        cache = StaticKVCache(layer.cache_spec(1, s.n_positions, dtype=torch.float32, device="cpu"))
        total = cache.nbytes * s.n_layer
        label = "MHA" if kv_heads == s.n_head else ("MQA" if kv_heads == 1 else "GQA")
        section.facts[f"{label} kv_heads={kv_heads}"] = {
            "query heads": s.n_head, "kv heads": kv_heads, "layers": s.n_layer,
            "attention parameters per layer": sum(p.numel() for p in layer.parameters()),
            f"cache bytes at {s.n_positions} tokens (float32)": total,
            "bytes per token": total // s.n_positions,
            "formula 2*layers*kv_heads*head_dim*4": 2 * s.n_layer * kv_heads * head_dim * 4,
        }
    return section
