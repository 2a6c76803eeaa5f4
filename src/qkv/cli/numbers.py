"""Command-line numbers, checked where they are parsed: finite, in range, or refused by name.

Each function returns an argparse `type=` that turns the text into a number or raises
`argparse.ArgumentTypeError`; argparse then prints one line naming the option
("argument --seed: must be a whole number from 0 to ..., got '1e23'") and exits with 2.
`--max-memory` sizes are read by the same rules as qkv.models.hf.untrusted.parse_size.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from qkv.models.hf.untrusted import parse_size

SEED_MAX = 2**63 - 1
# Temperatures below this overflow float32 logits (logits / T); use 0 for greedy.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {minimum:,} to {maximum:,}, got {text[:40]!r}"
            ) from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be from {minimum:,} to {maximum:,}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(minimum: float, maximum: float, *, exclusive_minimum: bool = False) -> Callable[[str], float]:
    low = "more than" if exclusive_minimum else "from"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {low} {minimum} to {maximum}, got {text[:40]!r}") from None
        too_low = value <= minimum if exclusive_minimum else value < minimum
        if not math.isfinite(value) or too_low or value > maximum:
            raise argparse.ArgumentTypeError(f"must be a number {low} {minimum} to {maximum}, got {text[:40]}")
        return value

    parse.__name__ = "number"
    return parse


def temperature(text: str) -> float:
    """0 (greedy) or a finite temperature between MIN_TEMPERATURE and MAX_TEMPERATURE."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:  # NaN and inf fail too
        raise argparse.ArgumentTypeError(
            f"must be 0 (greedy) or from {MIN_TEMPERATURE} to {MAX_TEMPERATURE:g}, got {text[:40]}"
        )
    return value


def seed(text: str) -> int:
    return integer(0, SEED_MAX)(text)


def probability(text: str) -> float:
    """A top-p value: more than 0, at most 1."""
    return number(0.0, 1.0, exclusive_minimum=True)(text)


def memory_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_max_memory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-memory", type=memory_size, metavar="SIZE",
        help="refuse a model whose estimated memory (weights while loading, from its config) "
        "exceeds SIZE, e.g. 2GB or 512MB (default: the memory this machine has available)",
    )
