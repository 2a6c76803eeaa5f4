"""`qkv perplexity`: how well a model predicts a text (lower is better), sliding window.

Used to measure quality claims on real weights: quantization, dtypes, cache changes.
The result goes to stdout; a progress bar over the scored tokens goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkv.precision import PRECISIONS
from qkv.text_file import read_text_file


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity of a decoder on a text file (sliding window)",
        description="Score a UTF-8 text file with a decoder: windows of --context-length tokens "
        "start --stride tokens apart and each scores only the tokens it adds, so every token "
        "is predicted once with up to context-length - stride tokens of history.",
    )
    parser.add_argument("--model", default="smollm2", metavar="M",
                        help="'smollm2', a .gguf file, or a checkpoint folder (default: %(default)s)")
    parser.add_argument("--data", required=True, metavar="FILE", help="UTF-8 text file to score")
    parser.add_argument("--context-length", type=int, default=1024, metavar="N",
                        help="tokens per window (default: %(default)s; at most the model's context)")
    parser.add_argument("--stride", type=int, metavar="S",
                        help="tokens between window starts (default: half the context length)")
    parser.add_argument("--dtype", choices=PRECISIONS, default="float32",
                        help="the weights to score, prepared as `qkv generate` prepares them: "
                        "float32 (exact), bfloat16, int8 or int4 (default: %(default)s); compare "
                        "them to see what a precision costs")
    parser.set_defaults(run=run)


def _read_text(path: Path) -> str:
    return read_text_file(path, when_empty="holds no text to score")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from qkv.perf.prepare import load_for_generation
    from qkv.perplexity import perplexity, windows

    stride = args.stride if args.stride is not None else max(1, args.context_length // 2)
    text = _read_text(Path(args.data))
    list(windows(2, args.context_length, stride))  # bad sizes are reported before loading
    model, tokenizer, _ = load_for_generation(args.model, precision=args.dtype, compile=False)
    ids = torch.tensor(tokenizer.encode(text).ids)  # (N,)
    with tqdm(total=max(ids.numel() - 1, 0), unit="tok", desc="scoring", file=sys.stderr,
              disable=None, leave=False) as bar:
        result = perplexity(model, ids, context_length=args.context_length, stride=stride, progress=bar.update)
    print(
        f"perplexity {result.perplexity:.3f} (mean NLL {result.nll:.4f} nats) on {result.tokens} tokens "
        f"of {args.data}, {result.windows} windows of {args.context_length} tokens, stride {stride}, {args.dtype}"
    )
    return 0
