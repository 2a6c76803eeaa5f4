"""`qkv` entry point: builds the parser from the subcommand modules and runs one.

Each subcommand module defines `register(subparsers)`, which adds its parser with its
defaults (defaults live in that one parser, nowhere else) and sets `run=<function(args) -> int>`.
A `QkvError` (bad input the user can fix) becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from qkv.errors import QkvError

# Subcommand modules under qkv.cli, in the order `qkv --help` lists them.
SUBCOMMANDS: tuple[str, ...] = ("explain", "train", "generate", "chat", "perplexity", "bench")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (and exit code 2), not usage + error."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="qkv",
        description="Attention from the key up: see the book's walkthrough, run and trace "
        "real decoders, train the book's GPT, measure speed.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"qkv.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except QkvError as error:
        print(f"qkv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
