"""Decoding options shared by `qkv generate`, `qkv chat` and `qkv perplexity`: the
precision (`--dtype`) and `--no-compile`. Importing this module imports no torch."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from qkv.precision import DEFAULT_PRECISION, PRECISIONS

if TYPE_CHECKING:
    from qkv.attention.kv_cache import CacheKind
    from qkv.models.decoder import CausalDecoder
    from qkv.perf.prepare import DecodeSetup


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", choices=PRECISIONS, default=DEFAULT_PRECISION,
        help="weights for decoding: float32 (exact: the checkpoint's numbers), bfloat16, int8 "
        "(weight-only, one scale per row) or int4 (weight-only, groups of 32). The default, "
        f"{DEFAULT_PRECISION}, is the fastest whose perplexity stays within 1%% of bfloat16's "
        "(benchmarks/RESULTS.md)",
    )


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    add_precision_argument(parser)
    parser.add_argument(
        "--no-compile", action="store_true",
        help="decode eagerly instead of compiling each layer with torch.compile (compiling is "
        "on by default wherever a C++ compiler works: a one-off 10-20 s, then seconds, kept in "
        "Inductor's on-disk cache)",
    )


def apply_speed_options(model: CausalDecoder, args: argparse.Namespace, kind: CacheKind | None = None) -> DecodeSetup:
    """Prepare the model as asked and compile its decode step (with caches of `kind`, the
    full cache by default) before the first token, saying so once on stderr (with the time
    it took, apart from tokens/s)."""
    from qkv.generation import warm_up
    from qkv.perf.prepare import prepare_for_decoding

    setup = prepare_for_decoding(model, precision=args.dtype, compile=not args.no_compile)
    if setup.compile is not None and not setup.compile.compiled:
        print(f"decoding eagerly: {setup.compile.reason} (--no-compile hides this line)",
              file=sys.stderr, flush=True)
    elif setup.compiled:
        seconds = warm_up(model) if kind is None else warm_up(model, kind=kind)
        print(f"compiled the decode step in {seconds:.1f} s", file=sys.stderr, flush=True)
    return setup
