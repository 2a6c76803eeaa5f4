"""plot: tokens/s of the next tokens at context length L, with the KV cache (a session
prefilled to L, truncated back to L before each timed call) and without it (the whole
prefix through a second copy of the model, no cache), float32, not compiled.

Shape legend: B batch (1), L context length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qkv.util.atomic import atomic_write_with
from qkv.bench.common import Context, Section
from qkv.bench.gpt2_checkpoint import load_qkv
from qkv.generation.decode_loop import DecodeLoop, RowRequest
from qkv.runtime import DecodeSession
from qkv.bench.measure.timing import Measurement, alternate

STEPS = 4  # decode steps per timed call with the cache


def plot_section(ctx: Context) -> Section:
    s = ctx.sizes
    section = Section("plot")
    folder = ctx.gpt2_checkpoint()
    prepared, plain_model = load_qkv(folder), load_qkv(folder).model
    ids = torch.randint(1, s.vocab, (1, max(s.plot_lengths) + 1), generator=torch.Generator().manual_seed(6))
    series: dict[str, list[float]] = {"with cache": [], "without cache": []}
    for length in s.plot_lengths:
        with DecodeSession(prepared.model, capacity=length + STEPS + 1, setup=prepared.setup) as session:
            logits = session.prefill(ids[:, :length])[0]  # once; each timed call truncates back to here

            def cached(length: int = length, session: DecodeSession = session, logits: torch.Tensor = logits) -> object:
                session.truncate(length)
                loop = DecodeLoop(session)  # STEPS decode steps of one greedy row, then its last choice
                loop.start(0, logits, RowRequest(max_tokens=STEPS + 1))
                while loop.running:
                    loop.step()
                return None

            def uncached(length: int = length) -> object:
                with torch.inference_mode():
                    return plain_model(ids[:, : length + 1])

            measured = alternate({"cached": cached, "uncached": uncached},
                                 work={"cached": STEPS, "uncached": 1}, unit="tokens", repeats=ctx.options.repeats)
        series["with cache"].append(measured["cached"].rate)
        series["without cache"].append(measured["uncached"].rate)
        section.measurements.extend(
            Measurement(f"{name} L={length}", m.work, m.unit, m.samples_s) for name, m in measured.items())
    section.facts["context lengths"] = list(s.plot_lengths)
    section.facts["tokens/s"] = {k: [round(x, 2) for x in v] for k, v in series.items()}
    if ctx.options.plot_path is not None:
        save_plot(ctx.options.plot_path, list(s.plot_lengths), series)
        section.facts["png"] = str(ctx.options.plot_path)
    return section


def save_plot(path: Path, lengths: list[int], series: dict[str, list[float]]) -> None:
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
