"""`qkv perplexity`: how well a model predicts a text (lower is better), sliding window.

Used to measure quality claims on real weights: quantization, dtypes, cache changes.
The result goes to stdout; a progress bar over the scored tokens goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qkv.cli.generate import DTYPES
from qkv.errors import QkvError
from qkv.text_file import read_text_file

if TYPE_CHECKING:
    from qkv.models.context_parallel import ContextParallel


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
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="weights and activations (default: %(default)s)")
    parser.add_argument("--context-parallel", nargs="?", type=int, const=0, metavar="N",
                        help="shard each window over the processes of a torchrun launch (ring "
                        "attention); N, if given, must be the number of processes")
    parser.add_argument("--sharding", choices=("zigzag", "contiguous"), default="zigzag",
                        help="how --context-parallel splits a window (default: %(default)s)")
    parser.set_defaults(run=run)


def _read_text(path: Path) -> str:
    return read_text_file(path, when_empty="holds no text to score")


def run(args: argparse.Namespace) -> int:
    if args.context_parallel is None:
        return _score(args, None)
    from qkv.models.context_parallel import join_context_parallel
    from qkv.training.distributed import init_distributed

    if "WORLD_SIZE" not in os.environ:
        raise QkvError(
            "--context-parallel needs a torch.distributed process group: run `torchrun "
            "--nproc_per_node N -m qkv perplexity --context-parallel ...`"
        )
    init_distributed(group_even_alone=True)
    try:
        expected = args.context_parallel or None
        cp = join_context_parallel(expected_world_size=expected, sharding=args.sharding)
        return _score(args, cp)
    except QkvError:
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
            return 2
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _score(args: argparse.Namespace, cp: "ContextParallel | None") -> int:
    from tqdm import tqdm

    from qkv.models.checkpoint import load_pretrained
    from qkv.perplexity import perplexity, windows

    stride = args.stride if args.stride is not None else max(1, args.context_length // 2)
    text = _read_text(Path(args.data))
    list(windows(2, args.context_length, stride))  # bad sizes are reported before loading
    model, tokenizer = load_pretrained(args.model, dtype=DTYPES[args.dtype])
    ids = torch.tensor(tokenizer.encode(text).ids)  # (N,)
    main = int(os.environ.get("RANK", "0")) == 0 or cp is None
    with tqdm(total=max(ids.numel() - 1, 0), unit="tok", desc="scoring", file=sys.stderr,
              disable=None if main else True, leave=False) as bar:
        result = perplexity(model, ids, context_length=args.context_length, stride=stride,
                            progress=bar.update, context_parallel=cp)
    if not main:
        return 0
    parallel = "" if cp is None else f", context-parallel over {cp.world_size} processes ({cp.sharding})"
    print(
        f"perplexity {result.perplexity:.3f} (mean NLL {result.nll:.4f} nats) on {result.tokens} tokens "
        f"of {args.data}, {result.windows} windows of {args.context_length} tokens, stride {stride}, {args.dtype}{parallel}"
    )
    return 0
