"""`qkv explain`: watch attention's data flow step by step, with real numbers.

Without a model it runs the book's six-token example ("Your journey starts with one
step", chapter 3.4) exactly as the book seeds it.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from qkv.errors import QkvError
from qkv.walkthrough import BOOK_D_OUT, BOOK_QUERY_POSITION, BOOK_SEED, run_walkthrough


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="step through attention for one query, with real numbers",
        description="Step through scaled dot-product attention for one query token: keys = "
        "inputs @ W_key, one score per key, scaling by 1/sqrt(d_k), softmax weights, and the "
        "context vector. Default: the book's example \"Your journey starts with one step\" with "
        "its 3-d embeddings, seed 123, d_out 2 and the query \"journey\".",
    )
    parser.add_argument("--query", type=int, default=BOOK_QUERY_POSITION, metavar="N",
                        help="the query token's position, counted from 1 as the book writes x(2) "
                        "(default: %(default)s)")
    parser.add_argument("--d-out", type=int, default=BOOK_D_OUT, metavar="D",
                        help="size of queries, keys and values (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=BOOK_SEED,
                        help="torch.manual_seed before drawing W_query, W_key, W_value "
                        "(default: %(default)s, the book's)")
    parser.add_argument("--causal", action="store_true",
                        help="apply the causal mask: the query sees only itself and earlier tokens")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with every step instead of the tables")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.d_out < 1:
        raise QkvError(f"--d-out must be at least 1, got {args.d_out}")
    try:
        walk = run_walkthrough(query_position=args.query, d_out=args.d_out, seed=args.seed,
                               causal=args.causal)
    except ValueError as error:
        raise QkvError(f"--query: {error}") from None
    if args.json:
        json.dump(walk.to_json(), sys.stdout)
        sys.stdout.write("\n")
        return 0
    from qkv.cli.walkthrough_view import render_walkthrough

    render_walkthrough(walk, Console(highlight=False))
    return 0
