"""`qkv bench`: sections in their own modules, one registry.

Each section is a function `(Context) -> Section` in its own module; SECTIONS maps a name
to "module:function" and `section_function` imports it only when it runs, so naming or
checking sections imports no torch. DEFAULT runs without --only (the sections on the
random GPT-2-124M shape and the model-free ones); `smollm2`, `quality`, `startup` and `kv-cache` run
when named (they load SmolLM2 or start processes). Sizes: QUICK (a smoke test of every
path) and FULL (what the issue's targets are measured at), in qkv.bench.common.

  decode     GPT-2-124M shape, float32, qkv as `qkv generate --dtype float32` prepares it
             (compiled) vs transformers float32, tokens/s, with a memory-read probe between
             every two runs
  roofline   the fraction of the bandwidth bound each qkv contender reaches (the bandwidth
             read just before and after each of decode's runs)
  prefill    a long prompt through the model, qkv vs transformers
  cache      new tokens with and without the KV cache (a small GPT)
  kv_bytes   KV-cache bytes of multi-head vs grouped-query configs of the same width
  attention  one causal self-attention forward: explicit, fused, raw SDPA, nn.MultiheadAttention
  plot       tokens/s against context length with and without the cache (PNG with --plot)
  smollm2    `qkv generate`'s defaults vs llama.cpp (same GGUF) and transformers, compile
             time, time to first token of a cold and a warm process
  quality    perplexity of SmolLM2 on --data in every precision, ratios to bfloat16
  startup    wall time of `qkv --help`, each subcommand's --help and `qkv explain`
  kv-cache   SmolLM2 through each cache kind: perplexity on --data and the long text,
             streaming past the context, bytes per token, decode speed at 4k int4 vs full,
             and kv-window's measurement
  kv-window  the bytes of a sliding-window layer's cache (a ring of W slots) against a full
             cache at 256, 1k, 4k and 16k positions: flat past W while the full one grows
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SECTIONS: dict[str, str] = {
    "decode": "qkv.bench.sections.decode:decode_section",
    "roofline": "qkv.bench.sections.roofline:roofline_section",
    "prefill": "qkv.bench.sections.prefill:prefill_section",
    "cache": "qkv.bench.sections.cache:cache_section",
    "kv_bytes": "qkv.bench.sections.cache:kv_bytes_section",
    "attention": "qkv.bench.sections.attention:attention_section",
    "plot": "qkv.bench.sections.plot:plot_section",
    "smollm2": "qkv.bench.sections.smollm2:smollm2_section",
    "quality": "qkv.bench.sections.quality:quality_section",
    "startup": "qkv.bench.sections.startup:startup_section",
    "kv-cache": "qkv.bench.sections.kv_cache:kv_cache_section",
    "kv-window": "qkv.bench.sections.window_memory:window_memory_section",
}
DEFAULT: tuple[str, ...] = ("decode", "roofline", "prefill", "cache", "kv_bytes", "attention", "plot")


def section_function(name: str) -> Callable[[Any], Any]:
    """The function that measures section `name` (imported now)."""
    module, function = SECTIONS[name].split(":")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def choose(only: list[str] | None) -> list[str]:
    """The sections to run, in the registry's order: DEFAULT, or those named in `only`
    (each item may be comma-separated). Unknown names raise QkvError."""
    from qkv.errors import QkvError

    if not only:
        return list(DEFAULT)
    names = [part.strip() for item in only for part in item.split(",") if part.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        raise QkvError(f"unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return [name for name in SECTIONS if name in names]
