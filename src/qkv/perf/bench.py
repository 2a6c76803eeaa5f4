"""The measurements behind `qkv bench`: qkv against transformers on the same weights.

Sections (each a function returning a `Section`; the CLI picks, prints and saves them):

1. decode    GPT-2-124M-shaped random checkpoint, batch 1, a 64-token prompt, 128 greedy
             new tokens: qkv.generate vs transformers' generate, float32 and bfloat16,
             plus the --compile / --quantize int8 variants; tokens/s end to end.
2. roofline  measured read bandwidth / bytes read per decode step (weights + KV cache at
             the mean context) = the tokens/s bound; the fraction each variant reaches,
             on decode steps alone (the prefill time, measured apart, is subtracted).
3. prefill   a 1024-token prompt through the model, qkv vs transformers, tokens/s.
4. cache     512 new tokens with and without the KV cache (a small GPT: without the
             cache each step reruns the whole prefix, minutes per run at 124M).
5. attention one causal self-attention forward: qkv explicit, qkv fused, raw
             scaled_dot_product_attention, nn.MultiheadAttention (which also projects).
6. kv_bytes  KV-cache bytes of multi-head vs grouped-query configs of the same width.
   quality   with --quantize int8: perplexity of the real SmolLM2 on the book's short
             story (float32, bfloat16, int8), or, without it, agreement of int8 logits
             and greedy tokens with float32 on the random GPT-2.
   plot      tokens/s against context length with and without the cache (PNG).

Every timed comparison alternates its contenders round by round; medians of `repeats`
runs; ratios from medians of the same run (qkv.perf.timing).

Shape legend: B batch (1 here), T prompt tokens, N new tokens, L context length.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import GroupedQueryAttention, explicit_attention, fused_attention
from qkv.atomic import atomic_write_with
from qkv.errors import QkvError
from qkv.generation import decode_one, generate, prefill
from qkv.models.checkpoint import load_pretrained
from qkv.models.decoder import CausalDecoder
from qkv.perf.bandwidth import Bandwidth, measure_read_bandwidth
from qkv.perf.compile import compile_decoder
from qkv.perf.linear import quantize_int8
from qkv.perf.prepare import prepare_for_decoding
from qkv.perf.roofline import roofline_tokens_per_s, token_bytes
from qkv.perf.timing import Measurement, Ratio, alternate, ratio

SECTIONS: tuple[str, ...] = ("decode", "roofline", "prefill", "cache", "attention", "kv_bytes", "quality", "plot")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Sizes:
    """Model and workload sizes; `full` is what the issue asks for, `quick` a smoke test."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    n_positions: int
    prompt: int
    new_tokens: int
    prefill: int
    cache_model: tuple[int, int, int, int]  # n_layer, n_embd, n_head, vocab of the small GPT
    cache_prompt: int
    cache_new: int
    attention_tokens: int
    plot_lengths: tuple[int, ...]
    bandwidth_bytes: int
    quality_tokens: int


FULL = Sizes(12, 768, 12, 50257, 1024, 64, 128, 1024, (4, 256, 4, 8192), 16, 512, 1024,
             (64, 128, 256, 512, 1020), 512 * 2**20, 2048)
QUICK = Sizes(2, 32, 2, 128, 64, 4, 6, 16, (2, 32, 2, 128), 4, 12, 32, (4, 8), 8 * 2**20, 32)


@dataclass
class Section:
    name: str
    measurements: list[Measurement] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # derived numbers, notes

    def to_dict(self) -> dict[str, Any]:
        return {
            "measurements": [m.to_dict() for m in self.measurements],
            "ratios": [r.to_dict() for r in self.ratios],
            "facts": self.facts,
        }


@dataclass(frozen=True)
class Options:
    sizes: Sizes
    repeats: int = 5
    compile: bool = False
    quantize: str | None = None
    plot_path: Path | None = None
    progress: Callable[[str], None] = lambda message: None


# ----------------------------------------------------------------------------- models


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise QkvError("qkv bench compares against transformers; install it: pip install 'qkv[dev]'") from None
    return transformers


def _write_tokenizer(folder: Path) -> None:
    """A small word-level tokenizer.json: the benchmark feeds token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "key": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def make_gpt2_checkpoint(folder: Path, n_layer: int, n_embd: int, n_head: int, vocab: int,
                         n_positions: int, *, seed: int = 0) -> Path:
    """A random-weight GPT-2 checkpoint written by transformers' save_pretrained."""
    tf = _transformers()
    config = tf.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                           n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    tf.GPT2LMHeadModel(config).save_pretrained(folder)
    _write_tokenizer(folder)
    return folder


def load_hf(folder: Path, dtype: torch.dtype) -> nn.Module:
    tf = _transformers()
    model = tf.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load_qkv(folder: Path, dtype: torch.dtype, *, quantize: str | None = None,
             compiled: bool = False, as_loaded: bool = False) -> CausalDecoder:
    """qkv's model as `qkv generate` prepares it (`prepare_for_decoding`), or as loaded."""
    model, _ = load_pretrained(folder, dtype)
    if as_loaded:
        return model
    return prepare_for_decoding(model, compile=compiled, quantize=quantize)


def qkv_variants(folder: Path, dtype_name: str, opts: Options) -> dict[str, CausalDecoder]:
    """The qkv contenders of one dtype, by name.

    "qkv <dtype>" is what `qkv generate` runs (column-major decode linears); float32 also
    runs the weights as loaded, to show what the layout is worth. --compile adds the
    compiled decode steps (layer by layer, as `qkv generate --compile` does; for float32
    also the whole forward pass as one graph: fewer calls per token, a compile time that
    grows with the depth), --quantize int8 weight-only int8 linears with bfloat16
    activations (eager and, with --compile, compiled). Int8 with float32 activations is
    left out: its eager prompt pass is slow (`_weight_int8pack_mm` at many rows).
    """
    dtype = DTYPES[dtype_name]
    variants: dict[str, CausalDecoder] = {}
    if dtype == torch.float32:
        variants["qkv float32 (as loaded)"] = load_qkv(folder, dtype, as_loaded=True)
    variants[f"qkv {dtype_name}"] = load_qkv(folder, dtype)
    if opts.compile:
        variants[f"qkv {dtype_name} compiled"] = load_qkv(folder, dtype, compiled=True)
        if dtype == torch.float32:
            whole, _ = load_pretrained(folder, dtype)
            variants["qkv float32 compiled (whole model)"] = compile_decoder(whole, whole_model=True)
    if opts.quantize == "int8" and dtype == torch.bfloat16:
        variants["qkv int8 (bfloat16 activations)"] = load_qkv(folder, dtype, quantize="int8")
        if opts.compile:
            variants["qkv int8 (bfloat16 activations) compiled"] = load_qkv(
                folder, dtype, quantize="int8", compiled=True)
    return variants


def hf_generate(model: nn.Module, ids: Tensor, new_tokens: int) -> Tensor:
    with torch.inference_mode():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )


def qkv_generate(model: CausalDecoder, ids: Tensor, new_tokens: int, *, use_cache: bool = True) -> Tensor:
    return generate(model, ids, new_tokens, use_cache=use_cache)


def _prefill_once(model: CausalDecoder, ids: Tensor) -> Callable[[], object]:
    """A contender running the prompt through a fresh cache, as generate's first step does."""

    def run() -> object:
        model.setup_cache(ids.shape[0], ids.shape[1] + 1)
        try:
            return prefill(model, ids)
        finally:
            model.remove_cache()

    return run


# ----------------------------------------------------------------------------- sections


@dataclass
class DecodeRun:
    """What the decode section leaves for the roofline section."""

    section: Section
    models: dict[str, CausalDecoder]  # qkv variants by contender name
    prefill_s: dict[str, float]  # median prompt time of each qkv variant
    context: float  # mean number of cached positions over the decode steps
    # The memory-read probe timed in the same rounds as each variant (see decode_section).
    bandwidth: dict[str, Measurement] = field(default_factory=dict)


BANDWIDTH_PROBE = "memory read (torch.sum)"
PROBE_SUMS = 16  # reductions per probe call: a few tenths of a second, comparable to a decode


def _bandwidth_probe(nbytes: int) -> Callable[[], object]:
    """A contender that reads `nbytes` of float32 PROBE_SUMS times (see qkv.perf.bandwidth)."""
    probe = torch.ones(nbytes // 4, dtype=torch.float32)  # (N,)

    def run() -> object:
        for _ in range(PROBE_SUMS):
            probe.sum()
        return None

    return run


def decode_section(folder: Path, opts: Options) -> DecodeRun:
    s = opts.sizes
    section = Section("decode")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, s.vocab, (1, s.prompt), generator=gen)  # (B, T)
    models: dict[str, CausalDecoder] = {}
    prefill_s: dict[str, float] = {}
    run_bandwidth: dict[str, Measurement] = {}
    for dtype_name, dtype in DTYPES.items():
        hf = load_hf(folder, dtype)
        variants = qkv_variants(folder, dtype_name, opts)
        reference = hf_generate(hf, ids, s.new_tokens)
        for name, model in variants.items():
            opts.progress(f"checking {name}")
            if "compiled" in name:
                warm = _timed(lambda m=model: qkv_generate(m, ids, s.new_tokens))
                section.facts[f"{name}: first call (compiles), s"] = warm
                state = model.compile_state  # type: ignore[attr-defined]
                section.facts[f"{name}: compiled path in use"] = state.active
            out = qkv_generate(model, ids, s.new_tokens)
            same = (out[:, s.prompt:] == reference[:, s.prompt:]).float().mean().item()
            section.facts[f"{name}: greedy tokens equal to transformers"] = round(same, 4)
        contenders: dict[str, Callable[[], object]] = {f"transformers {dtype_name}": lambda: hf_generate(hf, ids, s.new_tokens)}
        contenders.update({name: (lambda m=model: qkv_generate(m, ids, s.new_tokens)) for name, model in variants.items()})
        # The machine's bandwidth drifts (18-54 GB/s seen on one shared VM in one hour), so
        # the roofline's numerator is measured in the same rounds as the decoders it judges.
        probe = f"{BANDWIDTH_PROBE}, {dtype_name} rounds"
        contenders[probe] = _bandwidth_probe(s.bandwidth_bytes)
        opts.progress(f"timing {', '.join(contenders)}")
        work = {name: float(s.new_tokens) for name in contenders}
        work[probe] = float(s.bandwidth_bytes // 4 * 4 * PROBE_SUMS)
        timed = alternate(contenders, work=work, unit="tokens", repeats=opts.repeats)
        bandwidth = timed.pop(probe)
        bandwidth = Measurement(bandwidth.name, bandwidth.work, "bytes", bandwidth.samples_s)
        section.measurements.extend(timed.values())
        base = timed[f"transformers {dtype_name}"]
        section.ratios.extend(ratio(timed[name], base) for name in variants)
        run_bandwidth.update({name: bandwidth for name in variants})
        prompts = alternate({name: _prefill_once(model, ids) for name, model in variants.items()},
                            work=s.prompt, unit="tokens", repeats=opts.repeats)
        prefill_s.update({name: m.median_s for name, m in prompts.items()})
        models.update(variants)
        del hf
    section.facts["prompt tokens"] = s.prompt
    section.facts["new tokens"] = s.new_tokens
    context = s.prompt + (s.new_tokens - 1) / 2
    return DecodeRun(section, models, prefill_s, context, run_bandwidth)


def roofline_section(run: DecodeRun, bandwidth: Bandwidth) -> Section:
    """Fraction of the bandwidth bound each qkv variant reaches on its decode steps.

    Per round: bound = bandwidth read by the probe in that round / bytes per token, and
    achieved = decode steps / (generate time - median prompt time); the reported fraction
    is the median over rounds of achieved / bound (the probe ran next to the decoder, so
    both saw the same machine). A separate bandwidth measurement is shown for reference.
    """
    section = Section("roofline")
    section.facts["read bandwidth GB/s, separate measurement (median)"] = round(bandwidth.gb_per_s, 2)
    section.facts["bandwidth samples GB/s"] = [round(x, 2) for x in bandwidth.samples_gb_per_s]
    section.facts["mean cached positions per step"] = run.context
    new_tokens = run.section.facts["new tokens"]
    by_name = {m.name: m for m in run.section.measurements}
    for name, model in run.models.items():
        model.setup_cache(1, math.ceil(run.context))
        try:
            tb = token_bytes(model, round(run.context))
        finally:
            model.remove_cache()
        probe = run.bandwidth[name]
        gb_per_s = [probe.work / t / 1e9 for t in probe.samples_s]  # per round
        # generate's first token comes from the prefill; the others from decode steps.
        achieved = [(new_tokens - 1) / (t - run.prefill_s[name]) for t in by_name[name].samples_s]
        bounds = [roofline_tokens_per_s(tb.total, gb) for gb in gb_per_s]
        fractions = [a / b for a, b in zip(achieved, bounds, strict=True)]
        section.facts[name] = {
            "weight bytes per token": tb.weights,
            "kv bytes per token": tb.kv_cache,
            "read bandwidth GB/s in the same rounds (median)": round(statistics.median(gb_per_s), 2),
            "roofline tokens/s (median)": round(statistics.median(bounds), 2),
            "decode-step tokens/s (prefill subtracted, median)": round(statistics.median(achieved), 2),
            "fraction of roofline (median over rounds)": round(statistics.median(fractions), 4),
            "fraction of roofline per round": [round(f, 4) for f in fractions],
        }
    return section


def prefill_section(folder: Path, opts: Options) -> Section:
    s = opts.sizes
    section = Section("prefill")
    ids = torch.randint(1, s.vocab, (1, s.prefill), generator=torch.Generator().manual_seed(2))
    hf = load_hf(folder, torch.float32)
    ours = load_qkv(folder, torch.float32)

    def run_hf() -> object:
        with torch.inference_mode():
            return hf(ids, use_cache=False).logits

    def run_qkv() -> object:
        with torch.inference_mode():
            return ours(ids)

    with torch.inference_mode():
        diff = (run_hf() - run_qkv()).abs().max().item()  # type: ignore[operator]
    section.facts["max |logit difference| qkv vs transformers"] = diff
    timed = alternate({"transformers float32": run_hf, "qkv float32": run_qkv},
                      work=s.prefill, unit="tokens", repeats=opts.repeats)
    section.measurements.extend(timed.values())
    section.ratios.append(ratio(timed["qkv float32"], timed["transformers float32"]))
    section.facts["prompt tokens"] = s.prefill
    return section


def cache_section(opts: Options) -> Section:
    s = opts.sizes
    section = Section("cache")
    n_layer, n_embd, n_head, vocab = s.cache_model
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_gpt2_checkpoint(Path(tmp), n_layer, n_embd, n_head, vocab,
                                      s.cache_prompt + s.cache_new, seed=3)
        model = load_qkv(folder, torch.float32)
    ids = torch.randint(1, vocab, (1, s.cache_prompt), generator=torch.Generator().manual_seed(3))
    cached = qkv_generate(model, ids, s.cache_new)
    uncached = qkv_generate(model, ids, s.cache_new, use_cache=False)
    section.facts["greedy tokens equal with and without cache"] = bool(torch.equal(cached, uncached))
    section.facts["model"] = f"GPT-2 shape, n_layer={n_layer} n_embd={n_embd} n_head={n_head} vocab={vocab}"
    section.facts["prompt tokens"] = s.cache_prompt
    section.facts["new tokens"] = s.cache_new
    timed = alternate(
        {"with cache": lambda: qkv_generate(model, ids, s.cache_new),
         "without cache": lambda: qkv_generate(model, ids, s.cache_new, use_cache=False)},
        work=s.cache_new, unit="tokens", repeats=opts.repeats, warmup=0,
    )
    section.measurements.extend(timed.values())
    section.ratios.append(ratio(timed["with cache"], timed["without cache"]))
    return section


def attention_section(opts: Options) -> Section:
    s = opts.sizes
    section = Section("attention")
    c, h, t = s.n_embd, s.n_head, s.attention_tokens
    d = c // h
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, t, d, generator=gen) for _ in range(3))  # (B, H, T, D)
    x = torch.randn(1, t, c, generator=gen)  # (B, T, C)
    mha = nn.MultiheadAttention(c, h, batch_first=True).eval()
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # (T, T) True = hidden, its convention

    def explicit() -> object:
        return explicit_attention(q, k, v, is_causal=True)

    def fused() -> object:
        return fused_attention(q, k, v, is_causal=True)

    def raw() -> object:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def module() -> object:
        return mha(x, x, x, attn_mask=future, need_weights=False)

    with torch.inference_mode():
        section.facts["max |fused - raw SDPA|"] = (fused() - raw()).abs().max().item()  # type: ignore[operator]
        section.facts["max |explicit - raw SDPA|"] = (explicit()[0] - raw()).abs().max().item()  # type: ignore[index,operator]
        calls = max(1, round(2e8 / (h * t * t * d)))  # enough calls per sample to time
        timed = alternate(
            {name: _repeat(fn, calls) for name, fn in
             {"qkv explicit": explicit, "qkv fused": fused, "raw SDPA": raw, "nn.MultiheadAttention": module}.items()},
            work=calls, unit="calls", repeats=max(opts.repeats, 10),
        )
    section.measurements.extend(timed.values())
    base = timed["raw SDPA"]
    section.ratios.extend(ratio(timed[n], base) for n in ("qkv fused", "qkv explicit", "nn.MultiheadAttention"))
    section.facts["shape (B, H, T, D)"] = [1, h, t, d]
    section.facts["note"] = "nn.MultiheadAttention also runs its input and output projections"
    return section


def _repeat(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    def run() -> object:
        for _ in range(calls):
            fn()
        return None

    return run


def kv_bytes_section(opts: Options) -> Section:
    """Real cache sizes: build each config's attention layer, attach a full-length cache."""
    s = opts.sizes
    section = Section("kv_bytes")
    head_dim = s.n_embd // s.n_head
    rows = {}
    for kv_heads in sorted({s.n_head, max(1, s.n_head // 3), 1}, reverse=True):
        layer = GroupedQueryAttention(s.n_embd, s.n_head, num_kv_heads=kv_heads)
        cache = layer.setup_cache(1, s.n_positions, dtype=torch.float32, device="cpu")
        total = cache.nbytes * s.n_layer
        label = "MHA" if kv_heads == s.n_head else ("MQA" if kv_heads == 1 else "GQA")
        rows[f"{label} kv_heads={kv_heads}"] = {
            "query heads": s.n_head, "kv heads": kv_heads, "layers": s.n_layer,
            "attention parameters per layer": sum(p.numel() for p in layer.parameters()),
            f"cache bytes at {s.n_positions} tokens (float32)": total,
            "bytes per token": total // s.n_positions,
            "formula 2*layers*kv_heads*head_dim*4": 2 * s.n_layer * kv_heads * head_dim * 4,
        }
    section.facts.update(rows)
    return section


def _verdict_path() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.parent / "shared" / "data" / "the-verdict.txt"
        if candidate.is_file():
            return candidate
    raise QkvError("the book's short story (shared/data/the-verdict.txt) was not found next to the checkout")


def perplexity(model: CausalDecoder, ids: Tensor, window: int) -> float:
    """exp(mean next-token cross-entropy) over non-overlapping windows of `window` tokens."""
    losses, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, ids.shape[1] - 1, window):
            chunk = ids[:, start : start + window + 1]  # (1, <= window + 1)
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).float()  # (1, T, V)
            loss = F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            losses += loss.item()
            count += chunk.shape[1] - 1
    return math.exp(losses / count)


def quality_section(folder: Path, opts: Options) -> Section:
    """int8's cost: perplexity on real weights (SmolLM2) if they load, else agreement."""
    s = opts.sizes
    section = Section("quality")
    try:
        real, tokenizer = load_pretrained("smollm2", torch.float32)
    except Exception as error:  # noqa: BLE001 - any failure means "no real model here"
        section.facts["SmolLM2"] = f"not available ({type(error).__name__}: {error}); perplexity awaits real weights"
        real = None
    if real is not None:
        text = _verdict_path().read_text(encoding="utf-8")
        ids = torch.tensor([tokenizer.encode(text).ids[: s.quality_tokens]])  # (1, N)
        window = min(512, real.context_length - 1)
        ppl = {"float32": perplexity(real, ids, window)}
        ppl["bfloat16"] = perplexity(real.to(torch.bfloat16), ids, window)
        ppl["int8 (bfloat16 activations)"] = perplexity(quantize_int8(real), ids, window)
        section.facts["model"] = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"
        section.facts["tokens scored"] = int(ids.shape[1])
        section.facts["perplexity"] = {k: round(v, 4) for k, v in ppl.items()}
        section.facts["int8 / bfloat16 perplexity"] = round(ppl["int8 (bfloat16 activations)"] / ppl["bfloat16"], 5)
    ids = torch.randint(1, s.vocab, (1, s.prompt), generator=torch.Generator().manual_seed(5))
    base = load_qkv(folder, torch.float32)
    quant = load_qkv(folder, torch.float32, quantize="int8")
    with torch.inference_mode():
        a, b = base(ids), quant(ids)
    section.facts["random GPT-2: max |int8 - float32 logit| / max |logit|"] = (
        (a - b).abs().max() / a.abs().max()).item()
    section.facts["random GPT-2: argmax agreement over prompt positions"] = (
        (a.argmax(-1) == b.argmax(-1)).float().mean().item())
    greedy_a = qkv_generate(base, ids, s.new_tokens)[:, s.prompt:]
    greedy_b = qkv_generate(quant, ids, s.new_tokens)[:, s.prompt:]
    section.facts["random GPT-2: greedy tokens equal"] = (greedy_a == greedy_b).float().mean().item()
    return section


def plot_section(folder: Path, opts: Options) -> Section:
    """tokens/s of one more token at context length L, with the cache and without."""
    s = opts.sizes
    section = Section("plot")
    model = load_qkv(folder, torch.float32)
    ids = torch.randint(1, s.vocab, (1, max(s.plot_lengths) + 1), generator=torch.Generator().manual_seed(6))
    steps = 4  # decode steps per timed call; L + steps must fit the context
    series: dict[str, list[float]] = {"with cache": [], "without cache": []}
    for length in s.plot_lengths:
        model.setup_cache(1, length + steps)
        prefill(model, ids[:, :length])  # once; each timed call rewinds the cache to here

        def cached(length: int = length) -> object:
            for cache in model.caches():
                cache.length = length  # forget the tokens the previous call added
            token = ids[:, length : length + 1]
            for _ in range(steps):
                token = decode_one(model, token).argmax(-1, keepdim=True)
            return None

        def uncached(length: int = length) -> object:
            with torch.inference_mode():
                return model(ids[:, : length + 1])

        def without_cache(length: int = length) -> object:
            saved = model.caches()
            model.remove_cache()
            try:
                return uncached(length)
            finally:
                for layer, cache in zip(model.attention_layers(), saved):
                    layer.kv_cache = cache

        timed = alternate({"cached": cached, "uncached": without_cache},
                          work={"cached": steps, "uncached": 1}, unit="tokens", repeats=opts.repeats)
        model.remove_cache()
        series["with cache"].append(timed["cached"].rate)
        series["without cache"].append(timed["uncached"].rate)
        section.measurements.extend(
            Measurement(f"{name} L={length}", m.work, m.unit, m.samples_s) for name, m in timed.items())
    section.facts["context lengths"] = list(s.plot_lengths)
    section.facts["tokens/s"] = {k: [round(x, 2) for x in v] for k, v in series.items()}
    if opts.plot_path is not None:
        _save_plot(opts.plot_path, list(s.plot_lengths), series)
        section.facts["png"] = str(opts.plot_path)
    return section


def _save_plot(path: Path, lengths: list[int], series: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        ax.plot(lengths, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens already seen)")
    ax.set_ylabel("tokens/s for the next token")
    ax.set_title("qkv decode speed, GPT-2-124M shape, float32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


# ----------------------------------------------------------------------------- driver


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> dict[str, Any]:
    model_name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": model_name, "logical cpus": os.cpu_count(), "torch threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "load average (1, 5, 15 min)": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(Exception):
        info["transformers"] = _transformers().__version__
    return info


def run_sections(names: list[str], opts: Options) -> Iterator[Section]:
    """Run the named sections in order; yields each as soon as it is measured."""
    s, progress = opts.sizes, opts.progress
    needs_checkpoint = {"decode", "roofline", "prefill", "quality", "plot"} & set(names)
    with tempfile.TemporaryDirectory(prefix="qkv-bench-") as tmp:
        folder = Path(tmp)
        if needs_checkpoint:
            progress("building the random GPT-2 checkpoint")
            make_gpt2_checkpoint(folder, s.n_layer, s.n_embd, s.n_head, s.vocab, s.n_positions)
        run: DecodeRun | None = None
        for name in names:
            progress(name)
            if name == "decode" or (name == "roofline" and run is None):
                run = decode_section(folder, opts)
                if name == "decode":
                    yield run.section
            if name == "roofline":
                yield roofline_section(run, measure_read_bandwidth(s.bandwidth_bytes, max(opts.repeats, 5)))
            elif name == "prefill":
                yield prefill_section(folder, opts)
            elif name == "cache":
                yield cache_section(opts)
            elif name == "attention":
                yield attention_section(opts)
            elif name == "kv_bytes":
                yield kv_bytes_section(opts)
            elif name == "quality":
                yield quality_section(folder, opts)
            elif name == "plot":
                yield plot_section(folder, opts)
