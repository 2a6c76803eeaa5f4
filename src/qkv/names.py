"""The package's vocabulary: names that configs and every `--help` check without importing torch.

Attention kernels (`AttentionKernel`): the functions behind qkv.attention.kernels' one
signature. "explicit" spells out scores, mask and softmax (and returns the weights, which
tracing needs); "fused" calls PyTorch's scaled_dot_product_attention.

Precisions: what a decoder's weights are multiplied in. What each one does:
`qkv.runtime.prepare`. DEFAULT_PRECISION is "auto": int4 for a checkpoint whose layer weights
are already stored in 4-bit blocks (a Q4_0 or Q4_1 GGUF file, such as SmolLM2's), "blocks" for
a GGUF file in other block types (a Q4_K_M file: Q4_K, Q6_K, Q5_0, Q8_0, kept and multiplied as
stored, 4-6 bits a weight, where qkv's block products run), int8 for every other. The rule is
the fastest precision whose perplexity stays within 1% of bfloat16's. Measured on SmolLM2 with
qkv's kernels (benchmarks/RESULTS.md, the-verdict's first 1024 tokens scored through decode
steps): int4 0.9997x bfloat16's perplexity and int8 1.0020x, and int4's products take 7-18%
less time than int8's from 40% fewer weight bytes. A file already at 4 bits loses nothing more
at 4 bits: its blocks fall on qkv's. A float checkpoint would lose more, and no float
checkpoint can be measured offline here, so those stay at int8, whose cost does not depend on
how the checkpoint was made. The command line spells a precision `--dtype` (the flag users
know); the code says precision.
"""

from __future__ import annotations

from typing import Literal

AttentionKernel = Literal["explicit", "fused"]
ATTENTION_KERNELS: tuple[str, ...] = ("explicit", "fused")

PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4")  # any checkpoint
QUANTIZED: tuple[str, ...] = ("int8", "int4")
# A GGUF file's layers in the block types it stores (Q4_K, Q6_K, Q5_0, Q8_0...), multiplied as
# stored by qkv's block products (qkv.runtime.linear.block): the file's own weights, its own bits.
BLOCKS = "blocks"
AUTO = "auto"
CHOICES: tuple[str, ...] = (AUTO, *PRECISIONS, BLOCKS)  # what --dtype accepts
DEFAULT_PRECISION = AUTO


def resolve_precision(precision: str, *, stored_in_four_bits: bool, stored_in_blocks: bool = False) -> str:
    """The precision `precision` stands for on a checkpoint: "auto" becomes int4 for weights
    stored in 4-bit blocks (Q4_0/Q4_1), "blocks" for a GGUF file stored in other block types
    (`stored_in_blocks`: the caller says whether qkv's block products run here), else int8;
    the others stand for themselves."""
    if precision != AUTO:
        return precision
    return "int4" if stored_in_four_bits else BLOCKS if stored_in_blocks else "int8"


# The subcommands (modules under qkv.cli), in the order `qkv --help` lists them, with their summaries.
SUBCOMMANDS: dict[str, str] = {
    "explain": "step through attention for one query, with real numbers",
    "train": "train the book's GPT on a text file (resumable, torchrun-ready)",
    "generate": "continue a prompt with a decoder (GPT-2, Llama, Qwen, a folder qkv train wrote)",
    "chat": "talk with an instruction model (default: SmolLM2-135M-Instruct, offline)",
    "perplexity": "perplexity of a decoder on a text file (sliding window, or llama-perplexity's chunks)",
    "bench": "measure decode, prefill, cache and attention speed against transformers",
    "serve": "serve a decoder over an OpenAI-compatible HTTP API, with the live attention explorer",
}
