"""`--compile` and `--quantize`, shared by `qkv generate` and `qkv chat`."""

from __future__ import annotations

import argparse
import sys

from qkv.models.decoder import CausalDecoder
from qkv.perf.prepare import QUANTIZATIONS, prepare_for_decoding, warm_up


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step with torch.compile (Inductor, needs a C++ compiler): "
                        "about 2x faster decoding on CPU after a one-off compile of 10-20 s; "
                        "falls back to eager decoding, with a warning, where compiling fails")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, metavar="{int8}",
                        help="int8: weight-only int8 linear layers, a quarter of float32's bytes per token "
                        "(quality cost on SmolLM2: +0.1%% perplexity, see benchmarks/RESULTS.md)")


def apply_speed_options(model: CausalDecoder, args: argparse.Namespace) -> str:
    """Prepare the model as asked (compiling before the first token); a short label of the choice."""
    prepare_for_decoding(model, compile=args.compile, quantize=args.quantize)
    if args.compile:
        print("compiling the decode step (once, 10-20 s on 2 cores)....", file=sys.stderr, flush=True)
        seconds = warm_up(model)
        state = getattr(model, "compile_state", None)
        mode = "compiled" if state is not None and state.active else "eager (compiling failed)"
        print(f"{mode} in {seconds:.0f} s", file=sys.stderr, flush=True)
    parts = [args.quantize] if args.quantize else []
    if args.compile:
        parts.append("compiled")
    return ", ".join(parts)
