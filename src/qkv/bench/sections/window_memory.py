"""kv-window: the cache bytes of a sliding-window layer against a full one as a context grows.

For each context length N (256, 1k, 4k, 16k positions at FULL sizes), a session sized for N
positions (rounded as `qkv.generation` rounds capacities) gets one layer's cache of each
kind: the full cache (`StaticKVCache`) and the sliding-window ring (`WindowKVCache`). The
positions 0 .. N-1 are written into each through the cache interface, in prompt chunks, and
the bytes are then read off the tensors the cache holds (every distinct storage its buffers
live in, so nothing hidden escapes the count). The window's bytes stay flat past W while the
full cache's grow with N. The layer is Gemma 3 270M's (1 KV head of size 256, window 512,
bfloat16); the model-wide line counts its 15 local and 3 global layers from the same caches.

Shape legend: N context length (positions written), W window, H_kv key/value heads, D head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, KVCache, StaticKVCache
from qkv.attention.caches.window_cache import cache_kind_for
from qkv.bench.common import Context, Section


@dataclass(frozen=True)
class WindowSizes:
    lengths: tuple[int, ...]  # context lengths N measured
    window: int  # W of the local layer
    num_kv_heads: int
    head_dim: int
    local_layers: int  # of the model-wide count
    global_layers: int
    chunk: int = 512  # positions written per call (a chunked prompt)


FULL_WINDOW = WindowSizes((256, 1024, 4096, 16384), 512, 1, 256, 15, 3)
QUICK_WINDOW = WindowSizes((128, 512, 2048), 64, 1, 16, 5, 1, chunk=128)


def session_capacity(tokens: int) -> int:
    """The capacity a decode session allocates for `tokens` positions (the next power of
    two, at least 256: qkv.generation.session.cache_capacity without the context cap)."""
    return max(256, 1 << max(0, tokens - 1).bit_length())


def held_bytes(cache: KVCache) -> int:
    """Bytes of every distinct storage the cache's buffers live in."""
    storages = {buf.untyped_storage().data_ptr(): buf.untyped_storage().nbytes() for buf in cache.buffers()}
    return sum(storages.values())


def filled_cache(kind: CacheKind, sizes: WindowSizes, tokens: int) -> KVCache:
    """A cache of `kind` for a session of `tokens` positions, with positions 0 .. tokens-1 written."""
    spec = CacheSpec(1, sizes.num_kv_heads, session_capacity(tokens), sizes.head_dim, sizes.head_dim,
                     torch.bfloat16, torch.device("cpu"))
    cache = kind(spec)
    generator = torch.Generator().manual_seed(tokens)
    for begin in range(0, tokens, sizes.chunk):
        end = min(tokens, begin + sizes.chunk)
        k = torch.randn(1, sizes.num_kv_heads, end - begin, sizes.head_dim, generator=generator)  # (1, H_kv, t, D)
        cache.update(k.bfloat16(), k.bfloat16(), torch.arange(begin, end))
    if cache.length != tokens:
        raise RuntimeError(f"the {type(cache).__name__} holds {cache.length} positions after {tokens} were written")
    return cache


def window_memory(sizes: WindowSizes) -> dict[str, Any]:
    """Bytes of one local layer's ring and one full cache at each context length."""
    local_kind = cache_kind_for(sizes.window, StaticKVCache)
    rows: dict[str, Any] = {}
    for tokens in sizes.lengths:
        window = held_bytes(filled_cache(local_kind, sizes, tokens))
        full = held_bytes(filled_cache(StaticKVCache, sizes, tokens))
        rows[str(tokens)] = {
            "window layer bytes": window, "full layer bytes": full,
            "full / window": round(full / window, 2),
            "model bytes, local layers windowed": sizes.local_layers * window + sizes.global_layers * full,
            "model bytes, every layer full": (sizes.local_layers + sizes.global_layers) * full,
        }
    past = [row["window layer bytes"] for n, row in rows.items() if int(n) >= sizes.window]
    return {
        "layer": f"{sizes.num_kv_heads} KV head(s) of size {sizes.head_dim}, bfloat16, window {sizes.window}",
        "model": f"{sizes.local_layers} local + {sizes.global_layers} global layers",
        "by context length": rows,
        "window bytes flat past the window": len(set(past)) == 1,
        "full bytes grow with the context": all(
            a["full layer bytes"] < b["full layer bytes"] for a, b in zip(list(rows.values()), list(rows.values())[1:])),
    }


def window_memory_table(facts: dict[str, Any]) -> str:
    """The measurement as a Markdown table (what `qkv bench` prints it as, and RESULTS records)."""
    lines = ["| positions | window layer | full layer | full / window | model, local windowed | model, all full |",
             "|---:|---:|---:|---:|---:|---:|"]
    for tokens, row in facts["by context length"].items():
        lines.append(f"| {tokens} | {row['window layer bytes']:,} | {row['full layer bytes']:,} | "
                     f"{row['full / window']} | {row['model bytes, local layers windowed']:,} | "
                     f"{row['model bytes, every layer full']:,} |")
    return "\n".join(lines)


def window_memory_section(ctx: Context) -> Section:
    sizes = QUICK_WINDOW if ctx.sizes.quality_model == "gpt2" else FULL_WINDOW
    section = Section("kv-window")
    ctx.progress(f"sliding-window cache bytes at {', '.join(map(str, sizes.lengths))} positions")
    facts = window_memory(sizes)
    section.facts["windowed layer cache bytes"] = facts
    if not facts["window bytes flat past the window"]:
        section.skipped.append("kv-window: the window cache's bytes changed past its window")
    return section
