"""The quality cost of each decode precision, scored through decode steps: the first N tokens
of a text fed one token at a time through a KV cache (`cached_perplexity(chunk=1)`), so
every product runs on the kernels a generation uses (prompts of more than 16 rows take the
float path instead). Perplexity of bfloat16, int8 and int4, and each one's ratio to
bfloat16's.

    .venv/bin/python benchmarks/decode_quality.py [--tokens 1024] [--data ../shared/data/the-verdict.txt]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.generation.cache_kinds import cached_perplexity
from qkv.runtime.prepare import load_for_generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "the-verdict.txt"))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = Path(args.data).read_text(encoding="utf-8")
    scores: dict[str, float] = {}
    for precision in ("bfloat16", "int8", "int4"):
        model, tokenizer, setup = load_for_generation(args.model, precision=precision)
        ids = torch.tensor(tokenizer.encode(text).ids[: args.tokens])  # (N,)
        start = time.perf_counter()
        result = cached_perplexity(model, ids, StaticKVCache, capacity=ids.numel(), chunk=1)
        scores[precision] = result.perplexity
        print(f"{precision:9s} ({setup.describe()}): perplexity {result.perplexity:.4f} over {result.tokens} "
              f"tokens ({time.perf_counter() - start:.0f} s)", flush=True)
    for precision, value in scores.items():
        print(f"{precision:9s} {value / scores['bfloat16']:.4f}x bfloat16's perplexity")


if __name__ == "__main__":
    main()
