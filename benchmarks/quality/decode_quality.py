"""The quality cost of each decode precision, scored through decode steps: the first N tokens
of a text fed one token at a time through a KV cache (`cached_perplexity(chunk=1)`), so
every product runs on the kernels a generation uses (prompts of more than 16 rows take the
float path instead). Perplexity of bfloat16, int8 and int4, and each one's ratio to
bfloat16's.

    .venv/bin/python benchmarks/quality/decode_quality.py [--tokens 1024] [--data ../shared/data/the-verdict.txt] [--json PATH]

Nothing is timed against anything (the seconds printed are each precision's own); the
machine's facts head the output (benchmarks/harness.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.attention.caches.kv_cache import StaticKVCache  # noqa: E402
from qkv.generation.cache_kinds import cached_perplexity  # noqa: E402
from qkv.runtime.prepare import load_for_generation  # noqa: E402


def main() -> None:
    parser = harness.parser(__doc__, threads=2, json=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--data", default=str(harness.VERDICT))
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = harness.header("perplexity of each decode precision through decode steps")
    text = Path(args.data).read_text(encoding="utf-8")
    scores: dict[str, float] = {}
    setups: dict[str, str] = {}
    for precision in ("bfloat16", "int8", "int4"):
        model, tokenizer, setup = load_for_generation(args.model, precision=precision)
        ids = torch.tensor(tokenizer.encode(text).ids[: args.tokens])  # (N,)
        start = time.perf_counter()
        result = cached_perplexity(model, ids, StaticKVCache, capacity=ids.numel(), chunk=1, setup=setup)
        scores[precision] = result.perplexity
        setups[precision] = setup.describe()
        print(f"{precision:9s} ({setup.describe()}): perplexity {result.perplexity:.4f} over {result.tokens} "
              f"tokens ({time.perf_counter() - start:.0f} s)", flush=True)
    for precision, value in scores.items():
        print(f"{precision:9s} {value / scores['bfloat16']:.4f}x bfloat16's perplexity")
    if args.json:
        harness.write_json(args.json, {"model": args.model, "data": args.data, "tokens": args.tokens,
                                       "perplexity": scores, "setup": setups,
                                       "vs_bfloat16": {p: v / scores["bfloat16"] for p, v in scores.items()}}, facts)


if __name__ == "__main__":
    main()
