"""qkv generate's default path (load_for_generation("smollm2"): its default precision, compiled) against llama.cpp
(llama-cpp-python) on the same GGUF file: 32-token prompt, 64 greedy tokens, 2 threads, 4
alternating rounds, medians and their ratio. Needs llama-cpp-python (see benchmarks/README.md).

    .venv/bin/python benchmarks/decode/vs_llama_cpp.py [--rounds 4] [--tokens 64] [--threads 2] [--json PATH]

Each timed call is a whole generation (the prompt included) of --tokens tokens; the two
alternate round by round, who goes first rotating, with no warm-up round (qkv is warmed up
first): benchmarks/harness.py, qkv.bench.measure.timing's `alternate`. The newer
decode_vs_llama_bench.py compares against llama.cpp's own llama-bench instead.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

TEXT = ("The key to attention is a question each token asks of every other: how much do you matter to me? "
        "The answers are weights")


def main() -> None:
    parser = harness.parser(__doc__, rounds=4, threads=2, json=True)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per timed call (default: %(default)s)")
    args = parser.parse_args()
    from llama_cpp import Llama

    from qkv.generation import generate, warm_up
    from qkv.models.loader import smollm2_path
    from qkv.runtime.prepare import load_for_generation

    torch.set_num_threads(args.threads)
    facts = harness.header("qkv generate's default path against llama-cpp-python, same GGUF", packages=("llama_cpp_python",))
    model, tok, setup = load_for_generation("smollm2")
    t = time.time()
    warm_up(model, setup=setup)
    print("qkv", setup.describe(), "warm-up %.1fs" % (time.time() - t), flush=True)
    ids = torch.tensor([tok.encode(TEXT).ids[:32]])
    llm = Llama(model_path=str(smollm2_path()), n_threads=args.threads, n_ctx=512, verbose=False)

    def run_qkv() -> None:
        generate(model, ids, args.tokens, setup=setup)

    def run_llama() -> None:
        llm.reset()
        for n, _ in enumerate(llm.generate(ids[0].tolist(), temp=0.0, top_k=1), start=1):
            if n == args.tokens:
                break

    measured = harness.alternate({"qkv": run_qkv, "llama.cpp": run_llama}, work=args.tokens, unit="tokens",
                                 repeats=args.rounds, warmup=0)
    ratios = harness.ratios_over(measured, "llama.cpp")
    print(harness.table(measured.values(), ratios))
    print("median qkv %.1f  llama.cpp %.1f  ratio %.2f" % (measured["qkv"].rate, measured["llama.cpp"].rate,
                                                           ratios[0].value))
    if args.json:
        harness.write_json(args.json, {"qkv": setup.describe(), "tokens": args.tokens, "threads": args.threads,
                                       **harness.summary(measured.values(), ratios)}, facts)


if __name__ == "__main__":
    main()
