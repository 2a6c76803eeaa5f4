"""Decode through qkv's native whole-layer kernel against the same layers compiled by Inductor,
alternating in one process (so a shared machine's load falls on both alike).

Issue 24 put every family's layers (Gemma 2/3, Phi-3, Mistral, SmolLM3, OLMo 2, sliding-window
rings included) on `qkv::decoder_layer`; before, those families decoded through Inductor-compiled
modules. Both sides here load the same file at the same precision: "native" as `qkv generate`
prepares it now (`load_for_generation`), "inductor" loaded uncompiled and then compiled with
`compile_decoder` (the layers and the head: the path those families took before). Each round
times `--tokens` decode steps after a one-token prompt on each, in a session of slots as
`qkv generate` decodes; medians and their ratio are printed.

    .venv/bin/python benchmarks/native_layer_vs_inductor.py --model FILE.gguf [--dtype int8] \\
        [--threads 2] [--rounds 5] [--tokens 128]

Shape legend: V vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.generation import continue_from, warm_up
from qkv.runtime.compile import compile_decoder
from qkv.names import CHOICES
from qkv.runtime import DecodeSession, load_for_generation


def decode_rate(model: torch.nn.Module, tokens: int) -> tuple[float, bool]:
    """(decode tokens/s over `tokens` steps after a one-token prompt, whether it ran native)."""
    prompt = torch.zeros(1, dtype=torch.long)
    with DecodeSession(model, capacity=tokens + 8, kind=SlotKVCache) as session:
        logits = session.prefill_row(0, prompt)[None]  # (1, V)
        start = time.perf_counter()
        for _ in continue_from(session, logits, tokens + 1):  # tokens + 1 choices: `tokens` decode steps
            pass
        return tokens / (time.perf_counter() - start), session.runs_native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file or a checkpoint folder")
    parser.add_argument("--dtype", choices=CHOICES, default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native, _, setup = load_for_generation(args.model, precision=args.dtype)
    inductor, _, _ = load_for_generation(args.model, precision=args.dtype, compile=False)
    report = compile_decoder(inductor)
    for model in (native, inductor):
        warm_up(model, capacity=args.tokens + 8, kind=SlotKVCache)
    print(f"native: {setup.describe()}; inductor: {report}; {args.threads} threads; {args.model}", flush=True)
    rates: dict[str, list[float]] = {"native": [], "inductor": []}
    for round_ in range(args.rounds):
        for name, model in (("native", native), ("inductor", inductor)):
            rate, ran_native = decode_rate(model, args.tokens)
            if ran_native != (name == "native"):
                raise SystemExit(f"the {name} side {'did not run' if name == 'native' else 'ran'} the native layers")
            rates[name].append(rate)
        print(f"round {round_}: native {rates['native'][-1]:.1f} tokens/s, inductor {rates['inductor'][-1]:.1f}",
              flush=True)
    n, i = statistics.median(rates["native"]), statistics.median(rates["inductor"])
    print(f"median native {n:.1f} tokens/s, inductor {i:.1f} tokens/s, ratio {n / i:.2f}x")


if __name__ == "__main__":
    main()
