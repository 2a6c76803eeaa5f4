"""kv-cache: the cache kinds of qkv.generation.cache_kinds measured on a real model.

- perplexity through each kind (`cached_perplexity`, chunks of 32 tokens) on the text of
  --data (when given) and on the long text (qkv.util.long_text), with the ratio to the full
  cache: int4 and int2 (keys per channel, before RoPE), the per-token-keys ablation and
  keys quantized after RoPE at 2 bits, a sink
  cache (4 sinks + 252 recent at FULL sizes) and a window as large without sinks;
- streaming: the sink cache over more than twice the context length, the mean loss of
  each slice of the text and the slope of a line through them (flat: no upward trend);
- bytes per token of each kind in bfloat16, from real caches: what one more token of
  capacity adds (codes, scales and zero points included), against the full cache;
- the bytes of a sliding-window layer's cache against a full one at growing context
  lengths (qkv.bench.sections.window_memory, also its own section `kv-window`);
- decode speed at a long context (4k tokens at FULL sizes): the model as `qkv generate`
  prepares it by default, with the full cache and the int4 cache, alternating, same run.

SmolLM2 at FULL sizes (its context is 8192: the long text scores 8192 tokens, streaming
2.5 times that); a tiny random Llama at QUICK sizes (numbers without meaning, every path).

Shape legend: N tokens scored.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec
from qkv.bench.common import Context, Section
from qkv.bench.sections.window_memory import FULL_WINDOW, QUICK_WINDOW, window_memory
from qkv.generation.decode_loop import DecodeLoop, RowRequest
from qkv.runtime import DecodeSession
from qkv.generation.cache_kinds import cache_kind, cached_perplexity
from qkv.util.long_text import long_text, long_text_source
from qkv.bench.measure.timing import alternate, ratio
from qkv.util.text_file import read_text_file


@dataclass(frozen=True)
class KVSizes:
    model: str  # "smollm2" or "tiny"
    long_tokens: int  # tokens of the long text scored by every kind
    stream_factor: float  # the streaming run covers this many context lengths
    slice_tokens: int  # streaming slices
    speed_context: int  # decode speed measured after this many tokens
    speed_steps: int  # decode steps per timed round
    window: int  # the sink cache's recent tokens (after 4 sinks)
    chunk: int = 32

    def kinds(self) -> tuple[tuple[str, str, dict[str, Any]], ...]:
        """(label, kind name, options) of the kinds scored, in table order."""
        w = self.window
        return (
            ("full", "full", {}),
            ("int4, keys per channel", "int4", {}),
            ("int2, keys per channel", "int2", {}),
            ("int2, keys per token (ablation)", "int2", {"key_axis": "token"}),
            ("int2, keys quantized after RoPE", "int2", {"rope": "after"}),
            (f"sink, 4 sinks + {w} recent", "sink", {"sinks": 4, "window": w}),
            (f"window of {w + 4}, no sinks", "sink", {"sinks": 0, "window": w + 4}),
        )


FULL_KV = KVSizes("smollm2", 8192, 2.5, 1024, 4000, 16, 252)
QUICK_KV = KVSizes("tiny", 192, 2.5, 32, 100, 4, 28)


def _tiny_llama(precision: str) -> Any:
    """A random Llama small enough for QUICK runs, prepared like a loaded model."""
    from qkv.models.llama import LlamaForCausalLM
    from qkv.models.configs.llama import LlamaConfig
    from qkv.runtime.prepare import prepare_for_decoding

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    if precision != "float32":
        prepare_for_decoding(model, precision=precision, compile=False)
    return model


def _load(sizes: KVSizes, precision: str, compile: bool) -> tuple[Any, Any, Callable[[str], torch.Tensor]]:
    """(model, how it was prepared (None: its modules run), encode: text -> ids (N,))."""
    if sizes.model == "tiny":
        model = _tiny_llama(precision)
        return model, None, lambda text: torch.tensor([b % 128 for b in text.encode("utf-8")])
    from qkv.runtime.prepare import prepare

    prepared = prepare("smollm2", precision, compile=compile)
    return prepared.model, prepared.setup, lambda text: torch.tensor(prepared.tokenizer.encode(text).ids)


def kv_cache_section(ctx: Context) -> Section:
    sizes = QUICK_KV if ctx.sizes.quality_model == "gpt2" else FULL_KV
    section = Section("kv-cache")
    model, _, encode = _load(sizes, "float32", compile=False)
    section.facts["model"] = "SmolLM2-135M-Instruct, float32" if sizes.model == "smollm2" else "tiny random Llama"
    texts: dict[str, torch.Tensor] = {}
    if ctx.options.data is not None:
        texts[str(ctx.options.data)] = encode(read_text_file(ctx.options.data, when_empty="is empty"))
    else:
        section.skipped.append("kv-cache: --data not given, so only the long text is scored")
    long_ids = encode(long_text())
    texts[long_text_source()] = long_ids[: min(sizes.long_tokens, model.context_length)]
    _perplexities(ctx, section, model, texts, sizes)
    _streaming(ctx, section, model, long_ids, sizes)
    section.facts["bytes per token (bfloat16)"] = bytes_per_token(model)
    window_sizes = QUICK_WINDOW if sizes.model == "tiny" else FULL_WINDOW
    section.facts["windowed layer cache bytes"] = window_memory(window_sizes)  # flat past W (kv-window)
    del model
    _speed(ctx, section, sizes, encode)
    return section


def _perplexities(ctx: Context, section: Section, model: Any, texts: dict[str, torch.Tensor],
                  sizes: KVSizes) -> None:
    table: dict[str, dict[str, Any]] = {}
    for source, ids in texts.items():
        rows: dict[str, Any] = {}
        for label, name, options in sizes.kinds():
            ctx.progress(f"perplexity through the {label} cache, {ids.numel()} tokens of {source[:40]}")
            result = cached_perplexity(model, ids, cache_kind(name, **options),
                                       capacity=min(ids.numel(), model.context_length), chunk=sizes.chunk)
            rows[label] = {"perplexity": round(result.perplexity, 4)}
        full = rows["full"]["perplexity"]
        for row in rows.values():
            row["vs full"] = round(row["perplexity"] / full - 1, 5)
        labels = [label for label, _, _ in sizes.kinds()]
        ablation, per_channel = rows[labels[3]]["vs full"], rows[labels[2]]["vs full"]
        sink, window = rows[labels[5]], rows[labels[6]]
        table[source] = {
            "tokens": ids.numel(), "kinds": rows,
            "int2 per-token / per-channel loss": round(ablation / per_channel, 2) if per_channel > 0 else None,
            "no-sink window / sink loss": round(window["vs full"] / sink["vs full"], 2) if sink["vs full"] > 0 else None,
            "no-sink window / sink perplexity": round(window["perplexity"] / sink["perplexity"], 3),
        }
    section.facts["perplexity through each cache"] = table


def _streaming(ctx: Context, section: Section, model: Any, ids: torch.Tensor, sizes: KVSizes) -> None:
    n = int(model.context_length * sizes.stream_factor)
    ids = ids[:n]
    if ids.numel() < n:
        section.skipped.append(f"streaming: the long text has {ids.numel()} tokens, fewer than {n}")
        return
    ctx.progress(f"streaming {n} tokens ({sizes.stream_factor}x the context) through a sink cache")
    result = cached_perplexity(model, ids, cache_kind("sink", sinks=4, window=sizes.window),
                               capacity=sizes.window + 4, chunk=sizes.chunk, slice_tokens=sizes.slice_tokens)
    slices = result.window_nll
    section.facts["streaming past the context"] = {
        "tokens": result.tokens, "context length": model.context_length, "sinks + window": [4, sizes.window],
        "perplexity": round(result.perplexity, 4),
        "slice tokens": sizes.slice_tokens,
        "loss per slice": [round(x, 4) for x in slices],
        "slope of loss per 1000 tokens": round(1000 * slope(slices) / sizes.slice_tokens, 5),
        "loss, slices past 2x the context / slices before 1x": _past_over_before(slices, model.context_length,
                                                                                  sizes.slice_tokens),
    }


def slope(values: list[float]) -> float:
    """Least-squares slope of values against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values)) / sum((i - mean_x) ** 2 for i in range(n))


def _past_over_before(slices: list[float], context: int, size: int) -> float | None:
    before = slices[: context // size]
    past = slices[2 * context // size:]
    if not before or not past:
        return None
    return round(statistics.fmean(past) / statistics.fmean(before), 4)


def bytes_per_token(model: Any) -> dict[str, Any]:
    """What one more token of capacity costs each kind in bfloat16, over every layer."""
    layer = next(iter(model.attention_layers()))
    layers = sum(1 for _ in model.attention_layers())

    def nbytes(kind: CacheKind, capacity: int) -> int:
        spec = CacheSpec(1, layer.num_kv_heads, capacity, layer.head_dim, layer.head_dim,
                         torch.bfloat16, torch.device("cpu"))
        return kind(spec).nbytes * layers

    out: dict[str, Any] = {}
    full = (nbytes(cache_kind("full"), 8192) - nbytes(cache_kind("full"), 4096)) / 4096
    for name in ("full", "int4", "int2"):
        per = (nbytes(cache_kind(name), 8192) - nbytes(cache_kind(name), 4096)) / 4096
        out[name] = {"bytes": round(per, 2), "smaller than bfloat16": round(full / per, 3)}
    return out


def _speed(ctx: Context, section: Section, sizes: KVSizes, encode: Callable[[str], torch.Tensor]) -> None:
    """Two copies of the model as `qkv generate` prepares it (int8, compiled), one with each
    cache, prefilled once; rounds of decode steps alternate between them."""
    from qkv.names import DEFAULT_PRECISION

    ids = encode(long_text())[: sizes.speed_context][None]  # (1, N)
    rounds = ctx.options.repeats + 1
    capacity = sizes.speed_context + sizes.speed_steps * rounds  # positions 0 .. capacity - 1
    sessions: dict[str, tuple[DecodeSession, DecodeLoop]] = {}
    try:
        for label, name in (("full cache", "full"), ("int4 cache", "int4")):
            ctx.progress(f"decode speed at {sizes.speed_context} tokens: prefilling the {label}")
            model, setup, _ = _load(sizes, DEFAULT_PRECISION, compile=True)
            session = DecodeSession(model, capacity=capacity, kind=cache_kind(name), setup=setup).__enter__()
            loop = DecodeLoop(session)  # one greedy row, stepped in timed rounds (the one decode loop)
            loop.start(0, session.prefill(ids)[0], RowRequest(max_tokens=sizes.speed_steps * rounds + 1))
            sessions[label] = (session, loop)

        def steps(label: str) -> Callable[[], None]:
            _, loop = sessions[label]

            def run() -> None:
                for _ in range(sizes.speed_steps):
                    loop.step()
            return run

        ctx.progress("decode speed: timing")
        measured = alternate({label: steps(label) for label in sessions}, work=sizes.speed_steps,
                             unit="tokens", repeats=ctx.options.repeats, warmup=1)
    finally:
        for session, _ in sessions.values():
            session.close()
    section.measurements.extend(measured.values())
    section.ratios.append(ratio(measured["int4 cache"], measured["full cache"]))
    section.facts["decode speed context"] = sizes.speed_context
    section.facts["decode speed precision"] = f"{DEFAULT_PRECISION} weights, compiled (qkv generate's default)"
    if not math.isfinite(measured["int4 cache"].rate):
        section.skipped.append("decode speed: no finite rate")
