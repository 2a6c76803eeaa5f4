"""`qkv serve`: a local server with an OpenAI-compatible API, batched decoding, and the
live attention explorer at `/`."""

from __future__ import annotations

import argparse

from qkv.cli.serve_flags import add_front_door_arguments, check_serve_flags
from qkv.cli.speed import add_precision_argument
from qkv.cli.tensor_parallel import add_tensor_parallel_argument
from qkv.util.threads import FollowIdleCores, add_threads_argument, apply_threads


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        description="Serve a decoder over HTTP: OpenAI's /v1/chat/completions, /v1/completions and "
        "/v1/models (streaming too), /health, /metrics, and the attention explorer at /. "
        "Concurrent requests decode together (continuous batching).",
    )
    parser.add_argument("--model", default="smollm2", metavar="M",
                        help="checkpoint folder, a .gguf file, or 'smollm2' (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=8, metavar="N",
                        help="requests decoded together: KV cache slots (default: %(default)s)")
    parser.add_argument("--max-waiting", type=int, metavar="N",
                        help="requests that may wait for a slot before the server answers 503 "
                        "(default: 4 x --max-batch)")
    parser.add_argument("--context", type=int, default=1024, metavar="N",
                        help="positions per slot: prompt + answer of one request, at most the model's "
                        "context length. Every decode step reads all slots' positions (static shapes), so "
                        "a larger value costs time on every token (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=1024, metavar="N",
                        help="the most new tokens one request may ask for (default: %(default)s)")
    parser.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                        help="prefill every prompt whole, instead of starting from the longest prefix a slot "
                        "already holds (the keys and values of earlier requests)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1, /metrics and the explorer")
    add_tensor_parallel_argument(parser)
    add_front_door_arguments(parser)
    add_precision_argument(parser)
    add_threads_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    door = check_serve_flags(args)  # every flag in range before anything loads or binds
    if args.tensor_parallel is not None:  # rank 0 serves, the others follow its steps
        from qkv.cli.tensor_parallel import serve_rank, under_tensor_parallel

        return under_tensor_parallel(args, "serve", lambda a, tp: serve_rank(a, tp, door), barrier=False)
    from qkv.util.heap import freeze_loaded_heap, hold_collections

    hold_collections()  # until the model is loaded (qkv.util.heap: 0.2 s of start-up)
    from qkv.serve.http.app import build_app
    from qkv.serve.http.connections import bind_socket
    from qkv.serve.http.metrics import Metrics
    from qkv.serve.api.schemas import Limits
    from qkv.serve.http.server import load_served, serve

    sock = bind_socket(args.host, args.port)  # a port in use: one line, before any "listening on"
    try:
        # Without --threads the count follows the idle cores for the server's whole life.
        follow = FollowIdleCores() if args.threads is None else None
        served = load_served(args.model, precision=args.precision, max_batch=args.max_batch, capacity=args.context,
                             max_waiting=args.max_waiting, threads=follow, prefix_reuse=args.prefix_reuse)
        freeze_loaded_heap()  # the served model lives as long as the server: no collection walks it again
        metrics = Metrics()  # the stop line counts the requests it answered
        app = build_app(served, limits=Limits(max_tokens=args.max_tokens), api_key=args.api_key,
                        door=door, metrics=metrics)
        serve(app, sock=sock, door=door, served=served, metrics=metrics)
    finally:
        sock.close()
    return 0
