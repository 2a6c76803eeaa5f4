"""`qkv explain`: watch attention's data flow step by step, with real numbers.

Without a model it runs the book's six-token example ("Your journey starts with one
step", chapter 3.4) exactly as the book seeds it.
"""

from __future__ import annotations

import argparse
import json
import sys

from qkv.cli.explain.why import add_why_arguments, given_flags, wants_why
from qkv.cli.numbers import add_max_memory_argument, integer, seed
from qkv.errors import QkvError
from qkv.util.threads import add_threads_argument, apply_threads
from qkv.book.facts import BOOK_D_OUT, BOOK_QUERY_POSITION, BOOK_SEED, BOOK_TOKENS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        description="Step through scaled dot-product attention for one query token: keys = "
        "inputs @ W_key, one score per key, scaling by 1/sqrt(d_k), softmax weights, and the "
        "context vector. Default: the book's example \"Your journey starts with one step\" with "
        "its 3-d embeddings, seed 123, d_out 2 and the query \"journey\".",
    )
    parser.add_argument("text", nargs="?", metavar="TEXT",
                        help="your own text, traced through --model (without TEXT a model explains "
                        "\"The cat sat on the mat because it was tired\"; without a model: the book's example)")
    parser.add_argument("--model", metavar="M",
                        help="a real model: minilm (all-MiniLM-L6-v2, offline), smollm2, or a "
                        "checkpoint folder qkv loads (GPT-2, Llama, Qwen, Mistral, Phi-3, Gemma 2/3, OLMo 2, "
                        "SmolLM3, what qkv train writes)")
    parser.add_argument("--layer", type=integer(-2**20, 2**20), metavar="L",
                        help="the attention layer, counted from 0 as transformers counts (default: 0)")
    parser.add_argument("--head", type=integer(-2**20, 2**20), metavar="H",
                        help="the head, counted from 0 (default: 0)")
    parser.add_argument("--query", metavar="Q",
                        help="the query token: its position counted from 1 as the book writes x(2), "
                        f"or its text (default: {BOOK_QUERY_POSITION} for the book's example, the "
                        "last ordinary token of TEXT with --model)")
    parser.add_argument("--generate", type=integer(0, 10_000), metavar="N",
                        help="with a decoder: generate N tokens greedily and show the KV cache "
                        "growing, each new query scored against the cached keys")
    parser.add_argument("--png", metavar="DIR",
                        help="also write the figures (keys as arrows for d_out 2, score bars, "
                        "heatmap, causal mask, every head) as PNG files into DIR")
    parser.add_argument("--html", metavar="FILE",
                        help="also write one self-contained, interactive HTML page to FILE")
    parser.add_argument("--d-out", type=integer(1, 64), default=BOOK_D_OUT, metavar="D",
                        help="size of queries, keys and values (default: %(default)s)")
    parser.add_argument("--seed", type=seed, default=BOOK_SEED,
                        help="torch.manual_seed before drawing W_query, W_key, W_value "
                        "(default: %(default)s, the book's)")
    parser.add_argument("--causal", action="store_true",
                        help="apply the causal mask: the query sees only itself and earlier tokens")
    parser.add_argument("--keys", action="store_true",
                        help="with --model: the anatomy of its keys per layer and KV head (channel "
                        "magnitudes before/after RoPE, outlier channels, key norms, sink mass, RoPE "
                        "bands) against its values; with --png DIR and --html FILE also as figures "
                        "and one self-contained page")
    parser.add_argument("--tensor-parallel", type=integer(1, 2**16), metavar="N",
                        help="with --keys: which rank holds which KV head (with its query heads, its "
                        "slice of the MLP and of the vocabulary) when `qkv generate --tensor-parallel N` "
                        "splits the model, read from the file's description alone (no weights, no ranks)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with every step instead of the tables")
    add_why_arguments(parser)
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    parser.set_defaults(run=run)


def _and(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else ", ".join(flags[:-1]) + " and " + flags[-1]


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        book_only = [flag for flag, changed in (("--d-out", args.d_out != BOOK_D_OUT),
                     ("--seed", args.seed != BOOK_SEED), ("--causal", args.causal)) if changed]
        if book_only:
            verb = "applies" if len(book_only) == 1 else "apply"
            raise QkvError(f"{_and(book_only)} {verb} to the book's example only, since a --model "
                           "brings its own weights and masking; drop "
                           f"{'it' if len(book_only) == 1 else 'them'} or drop --model")
        apply_threads(args.threads)
        if wants_why(args):
            from qkv.cli.explain.why import run_why

            return run_why(args)
        if args.tensor_parallel is not None and not args.keys:
            raise QkvError("--tensor-parallel says where the keys live: give it with --keys")
        if args.keys:
            from qkv.cli.explain.keys import run_keys

            return run_keys(args)
        from qkv.cli.explain.model import run_model

        return run_model(args)
    if args.text is not None:
        raise QkvError("TEXT needs --model (for example --model minilm); without a model qkv "
                       "explains the book's example")
    if args.generate is not None:
        raise QkvError("--generate needs a decoder model: give --model")
    if wants_why(args):
        raise QkvError(f"{given_flags(args)[0]} needs a decoder: give --model (for example --model smollm2)")
    if args.keys:
        raise QkvError("--keys needs a real model: give --model (for example --model smollm2)")
    if args.d_out < 1:
        raise QkvError(f"--d-out must be at least 1, got {args.d_out}")
    from qkv.cli.explain.selection import check_range, resolve_query
    from qkv.book.walkthrough import run_walkthrough

    # The book's example is one attention layer with one head: 0 is the only valid choice.
    check_range(args.layer, 1, "--layer", "the book's example", "attention layer")
    check_range(args.head, 1, "--head", "the book's example", "head")
    if args.max_memory is not None:
        raise QkvError("--max-memory only applies with --model")
    apply_threads(args.threads)

    query_position = resolve_query(args.query, list(BOOK_TOKENS), BOOK_QUERY_POSITION - 1) + 1
    if args.png is not None or args.html is not None:
        from qkv.cli.explain.model import run_book_figures

        run_book_figures(args, query_position)
    try:
        walk = run_walkthrough(query_position=query_position, d_out=args.d_out, seed=args.seed,
                               causal=args.causal)
    except QkvError:
        raise
    except ValueError as error:
        raise QkvError(f"--query: {error}") from None
    if args.json:
        json.dump(walk.to_json(), sys.stdout)
        sys.stdout.write("\n")
        return 0
    from qkv.cli.explain.walkthrough_view import render_walkthrough

    from rich.console import Console

    render_walkthrough(walk, Console(highlight=False))
    return 0
