"""decode: the GPT-2-124M shape in float32, qkv with default flags (`--dtype float32`:
compiled) and without compiling, against transformers float32; 128 greedy new tokens
after a 64-token prompt, tokens/s of the whole call. A memory-read probe runs before the
first call and after every one, so the roofline section judges each decode by the
bandwidth measured just before and just after it.

Shape legend: B batch (1), T prompt tokens, N new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv.bench.common import Context, Section
from qkv.bench.gpt2_checkpoint import hf_generate, load_hf, load_qkv, qkv_generate
from qkv.runtime import DecodeSession
from qkv.generation import joined, stream, warm_up
from qkv.runtime.prepare import PreparedModel
from qkv.runtime.huge_pages import huge_ones
from qkv.bench.measure.timing import alternate_probed, ratio

PROBE_SUMS = 16  # reductions of the probe tensor per probe call: about 0.1-0.2 s here
COMPILED = "qkv float32 (default flags: compiled)"
EAGER = "qkv float32 --no-compile"
TRANSFORMERS = "transformers float32"


@dataclass
class DecodeRun:
    """What the decode section leaves for the roofline section."""

    section: Section
    models: dict[str, PreparedModel]  # qkv contenders by name
    first_token_s: dict[str, tuple[float, ...]]  # per timed call of each: seconds to its first token (the prompt)
    capacity: int  # the session's capacity (the roofline attaches caches of this size to count them)
    probe_bytes: float  # bytes one probe call reads
    around: dict[str, tuple[tuple[float, float], ...]]  # per contender sample: probe seconds before, after


def bandwidth_probe(nbytes: int, sums: int) -> tuple[Callable[[], object], float]:
    """A call that reads about `nbytes` of float32 `sums` times (see qkv.bench.measure.bandwidth), and
    the bytes one call reads."""
    probe = huge_ones(nbytes // 4)  # (N,) float32, on 2 MB pages as the prepared weights (qkv.runtime.huge_pages)

    def run() -> object:
        for _ in range(sums):
            probe.sum()
        return None

    return run, float(probe.numel() * probe.element_size() * sums)


def timed_generate(prepared: PreparedModel, ids: torch.Tensor, new_tokens: int, firsts: list[float]) -> torch.Tensor:
    """`generate`'s work (its own token stream, then the ids joined), with the seconds to the
    first token (the prompt's step) appended to `firsts`: the roofline takes each call's decode
    steps as its time after that, not after another call's median."""
    start = time.perf_counter()
    new: list[torch.Tensor] = []
    for token in stream(prepared.model, ids, new_tokens, setup=prepared.setup):
        if not new:
            firsts.append(time.perf_counter() - start)
        new.append(token)
    return joined(ids, new)  # (B, T + N)


def measure_decode(ctx: Context) -> DecodeRun:
    """Run once per bench run; decode and roofline both read it."""
    if "decode" in ctx.shared:
        return ctx.shared["decode"]  # type: ignore[no-any-return]
    s = ctx.sizes
    folder = ctx.gpt2_checkpoint()
    section = Section("decode")
    ids = torch.randint(1, s.vocab, (1, s.prompt), generator=torch.Generator().manual_seed(1))  # (B, T)
    hf = load_hf(folder)
    models = {COMPILED: load_qkv(folder, compile=True), EAGER: load_qkv(folder, compile=False)}
    ctx.progress("warming up (compiling) qkv")
    section.facts["compile (warm_up) s"] = round(warm_up(models[COMPILED].model, setup=models[COMPILED].setup), 3)
    reference = hf_generate(hf, ids, s.new_tokens)
    for name, model in models.items():
        out = qkv_generate(model, ids, s.new_tokens)
        same = (out[:, s.prompt:] == reference[:, s.prompt:]).float().mean().item()
        section.facts[f"{name}: greedy tokens equal to transformers"] = round(same, 4)
    contenders: dict[str, Callable[[], object]] = {TRANSFORMERS: lambda: hf_generate(hf, ids, s.new_tokens)}
    firsts: dict[str, list[float]] = {name: [] for name in models}  # each call's seconds to its first token
    contenders.update({name: (lambda m=model, f=firsts[name]: timed_generate(m, ids, s.new_tokens, f))
                       for name, model in models.items()})
    ctx.progress(f"timing {', '.join(contenders)}, with a memory read (torch.sum) between every two")
    # The machine's bandwidth drifts on a shared VM, so the roofline's numerator is
    # measured next to the decoders it judges: just before and just after each call.
    probe, probe_bytes = bandwidth_probe(s.bandwidth_bytes, PROBE_SUMS)
    probed = alternate_probed(contenders, probe, work=float(s.new_tokens),
                              unit="tokens", probe_work=probe_bytes, probe_unit="bytes",
                              repeats=ctx.options.repeats)
    measured = probed.measurements
    section.measurements.extend(measured.values())
    section.ratios.extend(ratio(measured[name], measured[TRANSFORMERS]) for name in models)
    section.ratios.append(ratio(measured[COMPILED], measured[EAGER]))
    capacity = DecodeSession(models[COMPILED].model, capacity=s.prompt + s.new_tokens).capacity
    section.facts["prompt tokens"] = s.prompt
    section.facts["new tokens"] = s.new_tokens
    section.facts["model"] = (f"GPT-2 shape, random weights: n_layer={s.n_layer} n_embd={s.n_embd} "
                              f"n_head={s.n_head} vocab={s.vocab}")
    timed = {name: tuple(f[-len(measured[name].samples_s):]) for name, f in firsts.items()}  # the timed calls' (not the warm-up's)
    run = DecodeRun(section, models, timed, capacity, probe_bytes,
                    probed.around)
    ctx.shared["decode"] = run
    return run


def decode_section(ctx: Context) -> Section:
    return measure_decode(ctx).section

