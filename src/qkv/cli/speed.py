"""Decoding options shared by `qkv generate`, `qkv chat` and `qkv perplexity`: the
precision (`--dtype`) and `--no-compile`. Importing this module imports no torch."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from qkv.names import CHOICES, DEFAULT_PRECISION

if TYPE_CHECKING:
    from qkv.attention.caches.kv_cache import CacheKind
    from qkv.models.decoder import CausalDecoder
    from qkv.runtime.prepare import DecodeSetup, PreparedModel


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", dest="precision", choices=CHOICES, default=DEFAULT_PRECISION,
        help="weights for decoding: float32 (exact: the checkpoint's numbers), bfloat16, int8 "
        "(weight-only, one scale per row), int4 (weight-only, groups of 32) or blocks (a GGUF "
        "file's own block types, Q4_K, Q6_K, Q5_0, Q8_0..., multiplied as stored). The default, "
        f"{DEFAULT_PRECISION}, is int4 for a checkpoint already stored in 4-bit blocks (a Q4_0/Q4_1 "
        "GGUF such as SmolLM2's), blocks for a GGUF file in other block types (a Q4_K_M file) and "
        "int8 otherwise: the fastest whose perplexity stays within 1%% "
        "of bfloat16's (benchmarks/RESULTS.md). int8, int4 and blocks run on qkv's own kernels "
        "(generic C++, AVX2 or AVX-512 VNNI, picked from the CPU), built for this machine on first "
        "use (QKV_NATIVE=0: the same math in PyTorch, slower)",
    )


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    add_precision_argument(parser)
    parser.add_argument(
        "--no-compile", action="store_true",
        help="decode with the layers as PyTorch modules, one operation at a time. By default the "
        "decode step is compiled wherever a C++ compiler works: float32, int8 and int4 models run "
        "each layer as one call of qkv's own kernels (built once per machine), and other cases "
        "(bfloat16, a quantized or sink KV cache) compile each layer with torch.compile (a "
        "one-off 10-20 s, then seconds, kept in Inductor's on-disk cache)",
    )


def load_for_speed(args: argparse.Namespace, *, chat: bool = False) -> PreparedModel:
    """Load `--model` prepared as asked (`--dtype`, `--no-compile`) through
    `qkv.runtime.prepare`, the path every command and the server share. Nothing is compiled yet."""
    from qkv.runtime.prepare import prepare
    from qkv.util.heap import freeze_loaded_heap

    prepared = prepare(args.model, args.precision, compile=not args.no_compile, max_memory=args.max_memory, chat=chat)
    freeze_loaded_heap()  # the model's objects stay alive to the end: the collector need not walk them again
    return prepared


def announce_speed(model: CausalDecoder, setup: DecodeSetup, kind: CacheKind | None = None) -> DecodeSetup:
    """Compile the decode step (for caches of `kind`, the full cache by default) before the
    first token, saying once on stderr what was built and how decoding runs (with the time
    it took, apart from tokens/s). qkv's whole-stack step on the default cache needs no
    warm-up: nothing is compiled, so nothing runs before the prompt."""
    from qkv.generation import warm_up
    from qkv.runtime.compile import CompileReport
    from qkv.util.progress import slow_step

    kernels = setup.kernels
    if kernels is not None and kernels.built_seconds is not None:
        print(f"built qkv's kernels for this CPU in {kernels.built_seconds:.1f} s (once per machine: "
              f"{kernels.path})", file=sys.stderr, flush=True)
    elif (kernels is not None and not kernels.available and "QKV_NATIVE" not in (kernels.reason or "")
          and setup.precision not in ("int8", "int4")):  # quantized layers say so themselves (qkv.runtime.linear.quantized)
        print(f"using PyTorch's {setup.precision} kernels: {kernels.reason}", file=sys.stderr, flush=True)
    if setup.compile is not None and not setup.compile.compiled:
        print(f"decoding eagerly: {setup.compile.reason} (--no-compile hides this line)",
              file=sys.stderr, flush=True)
    elif setup.layer_step is not None and kind is None:
        # qkv's whole-stack step compiles nothing and binds to the default cache as a session
        # opens: a throw-away warm-up would only delay the first token (by 0.3 s on a 1B file)
        print("decode steps run as one call of qkv's kernels per layer stack (nothing to compile)", file=sys.stderr, flush=True)
    elif setup.compiled:
        what = "the layer step" if setup.layer_step is not None else "the decode step (torch.compile)"
        with slow_step(f"compiling {what} for the first token"):
            seconds = warm_up(model, setup=setup) if kind is None else warm_up(model, kind=kind, setup=setup)
        fallback = setup.layer_step.fallback if setup.layer_step is not None else None
        if setup.layer_step is not None and fallback is None:
            print(f"decode steps run as one call of qkv's kernels per layer (ready in {seconds:.1f} s)",
                  file=sys.stderr, flush=True)
        elif isinstance(fallback, CompileReport) and not fallback.compiled:
            print(f"decoding eagerly: {fallback.reason} (--no-compile hides this line)", file=sys.stderr, flush=True)
        else:
            print(f"compiled the decode step in {seconds:.1f} s", file=sys.stderr, flush=True)
    return setup
