"""Perplexity of SmolLM2-135M-Instruct (float32 weights) read through chosen KV cache kinds:
a quick way to compare options that `qkv bench --only kv-cache` does not sweep.

    .venv/bin/python benchmarks/quality/kv_cache.py TEXT TOKENS KIND[:option=value...] ...
    e.g. benchmarks/quality/kv_cache.py ../shared/data/the-verdict.txt 1024 full int2 int2:rope=before
         benchmarks/quality/kv_cache.py long 8192 int4 int4:rope=before

TEXT is a file or `long` (qkv.util.long_text); its first TOKENS tokens are fed 32 at a time
(qkv.generation.cache_kinds.cached_perplexity). Not a test: numbers go to
benchmarks/RESULTS.md. Nothing is timed against anything; the machine's facts head the
output (benchmarks/harness.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.generation.cache_kinds import cache_kind, cached_perplexity  # noqa: E402
from qkv.runtime.prepare import load_for_generation  # noqa: E402
from qkv.util.long_text import long_text  # noqa: E402
from qkv.util.text_file import read_text_file  # noqa: E402

TEXT_OPTIONS = ("key_axis", "rope")  # the options that are words; the others are integers


def main(argv: list[str]) -> None:
    if len(argv) < 3 or any(a in ("-h", "--help") for a in argv):
        raise SystemExit(__doc__)
    torch.set_num_threads(2)
    harness.header("SmolLM2 perplexity through chosen KV cache kinds")
    model, tokenizer, _ = load_for_generation("smollm2", precision="float32", compile=False)
    text = long_text() if argv[0] == "long" else read_text_file(argv[0], when_empty="is empty")
    ids = torch.tensor(tokenizer.encode(text).ids)[: int(argv[1])]
    print(f"{ids.numel()} tokens of {argv[0]}, context {model.context_length}", flush=True)
    for spec in argv[2:]:
        name, *options = spec.split(":")
        pairs = dict(option.split("=") for option in options)
        kw = {key: (value if key in TEXT_OPTIONS else int(value)) for key, value in pairs.items()}
        start = time.time()
        result = cached_perplexity(model, ids, cache_kind(name, **kw),
                                   capacity=min(ids.numel(), model.context_length))
        print(f"{spec:40s} perplexity {result.perplexity:.3f} nll {result.nll:.4f} "
              f"bytes {result.cache_nbytes} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
