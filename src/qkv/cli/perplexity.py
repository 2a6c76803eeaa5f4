"""`qkv perplexity`: how well a model predicts a text (lower is better), sliding window.

Used to measure quality claims on real weights: quantization, dtypes, cache changes.
The result goes to stdout; a progress bar over the scored tokens goes to stderr when it is
a terminal.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.cli.numbers import add_max_memory_argument, integer
from qkv.cli.tensor_parallel import add_tensor_parallel_argument
from qkv.errors import QkvError
from qkv.names import BLOCKS, PRECISIONS
from qkv.util.text_file import read_text_file
from qkv.util.threads import CpuClock, add_threads_argument, apply_threads

if TYPE_CHECKING:
    from qkv.attention.caches.kv_cache import CacheKind
    from qkv.models.context_parallel import ContextParallel
    from qkv.models.tensor_parallel.group import TensorParallel

# The default window: the model's context, but no longer than this many tokens.
DEFAULT_CONTEXT_CAP = 1024
# llama-perplexity's default -c, the chunk size of --scheme llama-cpp.
LLAMA_CPP_CONTEXT = 512


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        description="Score a UTF-8 text file with a decoder: windows of --context-length tokens "
        "start --stride tokens apart and each scores only the tokens it adds, so every token "
        "is predicted once; after the first window each has at least context-length - stride "
        "tokens of history (and at most context-length - 1).",
    )
    parser.add_argument("--model", default="smollm2", metavar="M",
                        help="'smollm2', a .gguf file, or a checkpoint folder (default: %(default)s)")
    parser.add_argument("--data", required=True, metavar="FILE", help="UTF-8 text file to score")
    parser.add_argument("--context-length", type=integer(2, 2**24), metavar="N",
                        help="tokens per window (default: the model's context length, at most "
                        f"{DEFAULT_CONTEXT_CAP})")
    parser.add_argument("--stride", type=integer(1, 2**24), metavar="S",
                        help="tokens between window starts (default: half the context length)")
    parser.add_argument("--scheme", choices=("sliding", "llama-cpp"), default="sliding",
                        help="sliding: the windows above, every token scored once; llama-cpp: what "
                        "llama.cpp's llama-perplexity scores (non-overlapping chunks of --context-length "
                        f"tokens, default {LLAMA_CPP_CONTEXT} or the model's context if shorter, BOS first "
                        "in each, the second half of each scored; no --stride), so the two numbers "
                        "compare (default: %(default)s)")
    parser.add_argument("--dtype", dest="precision", choices=(*PRECISIONS, BLOCKS), default="float32",
                        help="the weights to score, prepared as `qkv generate` prepares them: "
                        "float32 (exact), bfloat16, int8, int4 or blocks (a GGUF file's own block "
                        "types, as stored) (default: %(default)s); compare them to see what a "
                        "precision costs")
    parser.add_argument("--context-parallel", nargs="?", type=int, const=0, metavar="N",
                        help="shard each window over the processes of a torchrun launch (ring "
                        "attention); N, if given, must be the number of processes")
    parser.add_argument("--sharding", choices=("zigzag", "contiguous"), default="zigzag",
                        help="how --context-parallel splits a window (default: %(default)s)")
    add_kv_cache_arguments(parser)
    parser.add_argument("--chunk", type=integer(1, 2**20), default=32, metavar="T",
                        help="with --kv-cache: tokens fed per step through the cache (default: %(default)s)")
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    add_tensor_parallel_argument(parser)
    parser.set_defaults(run=run)


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-cache and its options, shared by the commands that decode through a cache."""
    parser.add_argument("--kv-cache", metavar="KIND",
                        help="the KV cache: full, int4, int2 (keys per channel, values per token, "
                        "newest --residual tokens exact) or sink (--sink-tokens first tokens plus a "
                        "--window of recent ones)")
    parser.add_argument("--sink-tokens", type=integer(0, 2**20), default=4, metavar="S",
                        help="first tokens kept exact by int4/int2/sink caches (default: %(default)s)")
    parser.add_argument("--window", type=integer(1, 2**24), default=252, metavar="W",
                        help="recent tokens a sink cache keeps (default: %(default)s)")
    parser.add_argument("--residual", type=integer(0, 2**24), default=64, metavar="R",
                        help="newest tokens an int4/int2 cache keeps in full precision (default: %(default)s)")


def kv_cache_kind(args: argparse.Namespace) -> CacheKind | None:
    """The cache kind --kv-cache names (None without the option); bad options: QkvError."""
    if args.kv_cache is None:
        return None
    from qkv.generation.cache_kinds import cache_kind

    return cache_kind(args.kv_cache, sinks=args.sink_tokens, window=args.window, residual=args.residual)


def _read_text(path: Path) -> str:
    return read_text_file(path, when_empty="holds no text to score")


def run(args: argparse.Namespace) -> int:
    if args.tensor_parallel is not None:
        for given, option in ((args.context_parallel, "--context-parallel"), (args.kv_cache, "--kv-cache"),
                              (args.scheme == "llama-cpp" or None, "--scheme llama-cpp")):
            if given is not None:
                raise QkvError(f"--tensor-parallel scores the sliding windows of the whole model; drop {option}")
        from qkv.cli.tensor_parallel import under_tensor_parallel

        return under_tensor_parallel(args, "perplexity", lambda a, tp: _score(a, None, tp))
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


def _score(args: argparse.Namespace, cp: ContextParallel | None, tp: TensorParallel | None = None) -> int:
    started = CpuClock.now()  # the busy cores are watched while torch is imported (qkv.util.threads)
    import torch

    from qkv.runtime.prepare import prepare
    from qkv.eval.perplexity import perplexity, windows
    from qkv.util.progress import progress_bar

    threads = apply_threads(args.threads, since=started)
    kind = kv_cache_kind(args)  # bad cache options are reported before loading
    if kind is not None and cp is not None:
        raise QkvError("--kv-cache and --context-parallel do not combine; choose one")
    if args.scheme == "llama-cpp":
        return _score_llama_cpp(args, kind, cp, threads)
    text = _read_text(Path(args.data))
    if kind is not None:
        return _score_cached(args, kind, text, threads)
    if args.context_length is not None:  # bad sizes are reported before loading
        early_stride = args.stride if args.stride is not None else max(1, args.context_length // 2)
        list(windows(2, args.context_length, early_stride))
    if tp is None:
        prepared = prepare(args.model, args.precision, compile=False, max_memory=args.max_memory)
        model, tokenizer = prepared.model, prepared.tokenizer
    else:
        from qkv.cli.tensor_parallel import load_rank

        loaded, _ = load_rank(args, tp)
        model, tokenizer = loaded.model, loaded.tokenizer
    context_length = args.context_length or min(model.context_length, DEFAULT_CONTEXT_CAP)
    stride = args.stride if args.stride is not None else max(1, context_length // 2)
    list(windows(2, context_length, stride))
    ids = torch.tensor(tokenizer.encode(text).ids)  # (N,)
    main = (cp is None or int(os.environ.get("RANK", "0")) == 0) and (tp is None or tp.rank == 0)
    with progress_bar(total=max(ids.numel() - 1, 0), unit="tok", desc="scoring", leave=False,
                      enabled=main) as bar:
        result = perplexity(model, ids, context_length=context_length, stride=stride,
                            progress=bar.update, context_parallel=cp)
    if not main:
        return 0
    parallel = "" if cp is None else f", context-parallel over {cp.world_size} processes ({cp.sharding})"
    if tp is not None:
        parallel = f", tensor-parallel over {tp.world} processes"
    print(
        f"perplexity {result.perplexity:.3f} (mean NLL {result.nll:.4f} nats) on {result.tokens} tokens "
        f"of {args.data}, {result.windows} windows of {context_length} tokens, stride {stride}, "
        f"{args.precision}, {threads} thread{'s' if threads != 1 else ''}{parallel}"
    )
    return 0


def _score_cached(args: argparse.Namespace, kind: CacheKind, text: str, threads: int) -> int:
    import torch

    from qkv.generation.cache_kinds import cached_perplexity, check_kind
    from qkv.runtime.prepare import prepare
    from qkv.util.progress import progress_bar

    if args.chunk < 1:
        raise QkvError(f"--chunk must be at least 1, got {args.chunk}")
    prepared = prepare(args.model, args.precision, compile=False, max_memory=args.max_memory)
    model, tokenizer = prepared.model, prepared.tokenizer
    ids = torch.tensor(tokenizer.encode(text).ids)  # (N,)
    if ids.numel() < 2:
        raise QkvError(f"{args.data} has fewer than 2 tokens to score")
    check_kind(model, kind, chunk=args.chunk)
    if not model.streams_past_context(kind) and ids.numel() > model.context_length:
        raise QkvError(f"{args.data} has {ids.numel()} tokens, more than the model's context "
                       f"({model.context_length}); only --kv-cache sink on a model with RoPE streams past it")
    with progress_bar(total=ids.numel() - 1, unit="tok", desc="scoring", leave=False) as bar:
        result = cached_perplexity(model, ids, kind, capacity=min(ids.numel(), model.context_length),
                                   chunk=args.chunk, progress=bar.update)
    print(
        f"perplexity {result.perplexity:.3f} (mean NLL {result.nll:.4f} nats) on {result.tokens} tokens "
        f"of {args.data} through a {args.kv_cache} KV cache ({result.cache_nbytes / 2**20:.2f} MiB), "
        f"chunks of {args.chunk}, {args.precision}, {threads} thread{'s' if threads != 1 else ''}"
    )
    return 0


def _score_llama_cpp(args: argparse.Namespace, kind: CacheKind | None, cp: ContextParallel | None,
                     threads: int) -> int:
    """--scheme llama-cpp: llama-perplexity's chunks (qkv.eval.chunked_perplexity)."""
    import torch

    from qkv.eval.chunked_perplexity import (added_bos, check_chunk_length, chunk_count, chunked_perplexity,
                                        llama_cpp_text, scored_per_chunk)
    from qkv.util.progress import progress_bar
    from qkv.runtime.prepare import prepare

    for given, option in ((args.stride, "--stride"), (kind, "--kv-cache"), (cp, "--context-parallel")):
        if given is not None:
            raise QkvError(f"--scheme llama-cpp scores whole chunks from an empty cache; drop {option}")
    if args.context_length is not None:
        check_chunk_length(args.context_length)  # bad sizes are reported before loading
    text = llama_cpp_text(_read_text(Path(args.data)))
    prepared = prepare(args.model, args.precision, compile=False, max_memory=args.max_memory)
    model, tokenizer = prepared.model, prepared.tokenizer
    context_length = args.context_length or min(LLAMA_CPP_CONTEXT, model.context_length)
    ids = torch.tensor(tokenizer.encode(text).ids)  # (N,)
    chunks = chunk_count(ids.numel(), context_length)
    with progress_bar(total=chunks * scored_per_chunk(context_length), unit="tok", desc="scoring",
                      leave=False) as bar:
        result = chunked_perplexity(model, ids, context_length=context_length, bos_token_id=added_bos(tokenizer),
                                    progress=bar.update)
    print(
        f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.4f} nats) on {result.tokens} tokens "
        f"of {args.data} ({ids.numel()} in all), llama-perplexity's scheme: {result.windows} chunks of "
        f"{context_length} tokens, the second half of each scored, {args.precision}, "
        f"{threads} thread{'s' if threads != 1 else ''}"
    )
    return 0
