"""`qkv` entry point: builds the parser from the subcommand modules and runs one.

Each subcommand module defines `register(subparsers)`, which adds its parser with its
defaults (defaults live in that one parser, nowhere else) and sets `run=<function(args) -> int>`.
Only the module of the command being run is imported (they bring torch), so `qkv --help`
and `qkv --version` answer at once; the one-line summaries `qkv --help` lists live here.
A `QkvError` (bad input the user can fix) becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

import qkv
from qkv.util.heap import thaw_loaded_heap
from qkv.errors import QkvError
from qkv.names import SUBCOMMANDS



class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (and exit code 2), not usage + error."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv: its first word that is not an option (qkv's own
    options, -h and --version, take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported and adds its options (None: none)."""
    parser = OneLineErrorParser(
        prog="qkv",
        description="Attention from the key up: see the book's walkthrough, run and trace "
        "real decoders, train the book's GPT, measure speed.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {qkv.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in SUBCOMMANDS.items():
        if name == command:
            importlib.import_module(f"qkv.cli.{name}").register(subparsers)
        else:
            subparsers.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command(argv))
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
    finally:
        thaw_loaded_heap()  # a command run in-process leaves its caller's collector as it found it


if __name__ == "__main__":
    raise SystemExit(main())
