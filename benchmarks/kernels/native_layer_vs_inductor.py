"""Decode through qkv's native whole-layer kernel against the same layers compiled by Inductor,
alternating in one process (so a shared machine's load falls on both alike).

Issue 24 put every family's layers (Gemma 2/3, Phi-3, Mistral, SmolLM3, OLMo 2, sliding-window
rings included) on `qkv::decoder_layer`; before, those families decoded through Inductor-compiled
modules. Both sides here load the same file at the same precision: "native" as `qkv generate`
prepares it now (`load_for_generation`), "inductor" loaded uncompiled and then compiled with
`compile_decoder` (the layers and the head: the path those families took before). Each round
times `--tokens` decode steps after a one-token prompt on each, in a session of slots as
`qkv generate` decodes (each side times its own steps: benchmarks/harness.py's
`self_timed`, the rounds those of qkv.bench.measure.timing's `alternate`, who goes first
rotating); medians and their ratio are printed.

    .venv/bin/python benchmarks/kernels/native_layer_vs_inductor.py --model FILE.gguf [--dtype int8] \\
        [--threads 2] [--rounds 5] [--tokens 128] [--json PATH]

Shape legend: V vocabulary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.attention.caches.kv_cache import SlotKVCache  # noqa: E402
from qkv.generation import continue_from, warm_up  # noqa: E402
from qkv.names import CHOICES  # noqa: E402
from qkv.runtime import DecodeSession, DecodeSetup, load_for_generation  # noqa: E402
from qkv.runtime.compile import compile_decoder  # noqa: E402


def decode_seconds(model: torch.nn.Module, setup: DecodeSetup | None, tokens: int) -> tuple[float, bool]:
    """(seconds of `tokens` decode steps after a one-token prompt, whether it ran native)."""
    prompt = torch.zeros(1, dtype=torch.long)
    with DecodeSession(model, capacity=tokens + 8, kind=SlotKVCache, setup=setup) as session:
        logits = session.prefill_row(0, prompt)[None]  # (1, V)
        start = time.perf_counter()
        for _ in continue_from(session, logits, tokens + 1):  # tokens + 1 choices: `tokens` decode steps
            pass
        return time.perf_counter() - start, session.runs_native


def side(name: str, model: torch.nn.Module, setup: DecodeSetup | None, tokens: int):
    """One contender: its decode seconds, after checking it ran (or did not run) the native layers."""

    def run() -> float:
        seconds, ran_native = decode_seconds(model, setup, tokens)
        if ran_native != (name == "native"):
            raise SystemExit(f"the {name} side {'did not run' if name == 'native' else 'ran'} the native layers")
        print(f"{name}: {tokens / seconds:.1f} tokens/s", flush=True)
        return seconds

    return run


def main() -> None:
    parser = harness.parser(__doc__, rounds=5, threads=2, json=True)
    parser.add_argument("--model", required=True, help="a .gguf file or a checkpoint folder")
    parser.add_argument("--dtype", choices=CHOICES, default="int8")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = harness.header("decode: qkv's native layers against the same layers compiled by Inductor")
    native, _, setup = load_for_generation(args.model, precision=args.dtype)
    inductor, _, _ = load_for_generation(args.model, precision=args.dtype, compile=False)
    report = compile_decoder(inductor)
    for model, how in ((native, setup), (inductor, None)):
        warm_up(model, capacity=args.tokens + 8, kind=SlotKVCache, setup=how)
    print(f"native: {setup.describe()}; inductor: {report}; {args.threads} threads; {args.model}", flush=True)
    measured = harness.self_timed({"native": side("native", native, setup, args.tokens),
                                   "inductor": side("inductor", inductor, None, args.tokens)},
                                  work=args.tokens, unit="tokens", rounds=args.rounds)
    ratios = harness.ratios_over(measured, "inductor")
    print(harness.table(measured.values(), ratios))
    n, i = measured["native"].rate, measured["inductor"].rate
    print(f"median native {n:.1f} tokens/s, inductor {i:.1f} tokens/s, ratio {ratios[0].value:.2f}x")
    if args.json:
        harness.write_json(args.json, {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                                       "native": setup.describe(), "inductor": str(report),
                                       **harness.summary(measured.values(), ratios)}, facts)


if __name__ == "__main__":
    main()
