"""How a prompt is cut into the parts it is prefilled in, and which held prefix a prefill may keep.

    aligned_parts(0, 150)          # [(0, 64), (64, 128), (128, 150)]
    reusable_prefix(150, held=100) # 64: the whole parts of what a row holds
    common_prefix(a, b)            # how many leading tokens two prompts share

The modules' products and attention choose their blocking by the row count, so a prompt
computed through them in other cuts would write other last bits; cutting every prompt at the
same multiples (PREFILL_ALIGN) makes a prompt prefilled whole, after a kept prefix, alone or in
a server's slot write the same numbers (qkv.runtime.session; the native layers compute each
token alone, so any cut gives their numbers).
"""

from __future__ import annotations

# Prompts are prefilled in parts that begin and end at multiples of this many positions
# (the last part ends with the prompt). A part's numbers depend only on its tokens and what the
# cache holds before it, never on how long the rest of the prompt is (the matrix products and
# the attention kernel choose their blocking by the row count), so a prompt prefilled whole,
# after a kept prefix, alone or in a server's slot writes the same numbers.
PREFILL_ALIGN = 64


def aligned_parts(start: int, end: int, align: int = PREFILL_ALIGN) -> list[tuple[int, int]]:
    """[start, end) cut at the multiples of `align`: the parts a prompt is prefilled in."""
    cuts = [start, *range((start // align + 1) * align, end, align), end]
    return list(zip(cuts[:-1], cuts[1:]))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_prefix(length: int, held: int, align: int = PREFILL_ALIGN) -> int:
    """How many of the `held` leading positions of a `length`-token prompt a prefill may keep
    (rather than compute again) and still write what a whole prefill of the prompt writes:
    the whole parts (`align`) among them, leaving at least the last token to compute.
    Positions written by decode steps are not whole parts: a server keeps prompts only.
    align=1 where each token is computed alone (`DecodeSession.prompt_align`): any prefix."""
    return (min(held, length - 1) // align) * align if length > 0 else 0
