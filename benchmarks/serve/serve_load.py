"""Load generator for `qkv serve`, with the official `openai` client, on loopback only.

    python benchmarks/serve/serve_load.py --model smollm2 --clients 1 4 8 --requests 8 --max-tokens 64
    python benchmarks/serve/serve_load.py --model smollm2 --clients 8 --churn 200 --max-tokens 24

Starts `qkv serve` as a subprocess on a free 127.0.0.1 port, then for each client count
sends the same `--requests` streaming chat requests from that many threads (greedy, `ignore`
stop: each answer is cut at --max-tokens or the end token) and reports tokens/s of the
whole run, p50/p95 time to first token and inter-token latency. With --churn N it sends N
requests from the largest client count instead, closing every fourth mid-stream, and checks
every completed answer against the prompt's answer alone, the slots (occupancy 0 after) and
the server's memory (RSS before and after). Everything is bounded by
--timeout; the server is stopped at the end (benchmarks/harness.py's `running`). One
contender: benchmarks/serve/serve_vs_llama.py runs this load against llama-server too.

--endpoint chat (the default) streams /v1/chat/completions of the prompts as user messages;
--endpoint completions streams /v1/completions of the same prompts as raw text, for a file
without a chat template (Gemma 3 270M's GGUF: qkv serve answers its chats with 400). Chosen
by hand, not guessed from the file, so that a run's load is what its command says.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

PROMPTS = ["Explain attention in one paragraph.", "Write a short poem about keys and values.",
           "What is a KV cache?", "Describe the cat that sat on the mat.", "Why is the sky blue?",
           "List three uses of transformers.", "Tell a story about a small robot.", "What is softmax?"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


ENDPOINTS = ("chat", "completions")


def streamed(client: OpenAI, model: str, prompt: str, max_tokens: int, endpoint: str = "chat",
             usage: bool = False) -> Iterator[tuple[str, int | None]]:
    """(text, None) per streamed chunk with text, then ("", completion tokens) when `usage`
    is asked and the server reports it: one greedy stream of `prompt` on either endpoint."""
    options = {"stream_options": {"include_usage": True}} if usage else {}
    if endpoint == "chat":
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True, **options)
    else:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, **options)
    with stream:
        for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            text = None if choice is None else choice.delta.content if endpoint == "chat" else choice.text
            if text:
                yield text, None
            if chunk.usage is not None:
                yield "", chunk.usage.completion_tokens


def one(client: OpenAI, model: str, prompt: str, max_tokens: int, endpoint: str = "chat"
        ) -> tuple[float, list[float], int]:
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    for text, used in streamed(client, model, prompt, max_tokens, endpoint, usage=True):
        if text:
            stamps.append(time.perf_counter())
        if used is not None:
            tokens = used
    ttft = stamps[0] - start if stamps else float("nan")
    return ttft, [b - a for a, b in zip(stamps, stamps[1:])], tokens


def run(client: OpenAI, model: str, clients: int, requests: int, max_tokens: int, endpoint: str = "chat"
        ) -> dict[str, float]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one(client, model, p, max_tokens, endpoint), prompts))
    elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {"clients": clients, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "ttft_p50": _percentile(ttfts, 0.5), "ttft_p95": _percentile(ttfts, 0.95),
            "itl_p50": _percentile(gaps, 0.5), "itl_p95": _percentile(gaps, 0.95)}


def _text(client: OpenAI, model: str, prompt: str, max_tokens: int, cancel_after: int | None = None,
          endpoint: str = "chat") -> str | None:
    """The streamed answer, or None when the stream is closed after `cancel_after` chunks."""
    parts: list[str] = []
    chunks = streamed(client, model, prompt, max_tokens, endpoint)
    for text, _ in chunks:
        parts.append(text)
        if cancel_after is not None and len(parts) >= cancel_after:
            chunks.close()  # closing the generator closes the connection mid-stream
            return None
    return "".join(parts)


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status", encoding="ascii"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def churn(client: OpenAI, model: str, pid: int, clients: int, requests: int, max_tokens: int,
          endpoint: str = "chat") -> None:
    """`requests` requests from `clients` threads, every fourth closed after 3 chunks: each
    completed answer must equal the same prompt's answer when it ran alone."""
    alone = {p: _text(client, model, p, max_tokens, endpoint=endpoint) for p in PROMPTS}
    before = _rss_mb(pid)
    jobs = [(PROMPTS[i % len(PROMPTS)], 3 if i % 4 == 3 else None) for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda job: _text(client, model, job[0], max_tokens, job[1], endpoint), jobs))
    elapsed = time.perf_counter() - start
    completed = [(job[0], a) for job, a in zip(jobs, answers) if a is not None]
    same = sum(a == alone[p] for p, a in completed)
    print(f"churn: {requests} requests from {clients} clients in {elapsed:.1f} s, "
          f"{requests - len(completed)} cancelled mid-stream, {len(completed)} completed, "
          f"{same} of them equal to the prompt's answer alone; server RSS {before:.0f} -> {_rss_mb(pid):.0f} MB")


def main() -> int:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--dtype", help="the server's --dtype (default: qkv serve's own)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                        help="streamed chats, or raw-text completions of the same prompts (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--churn", type=int, metavar="N",
                        help="instead: N requests from the largest client count, a quarter closed mid-stream")
    args = parser.parse_args()
    facts = harness.header(f"qkv serve under load: {args.model}, loopback")
    port = harness.free_port()
    command = [sys.executable, "-m", "qkv", "serve", "--model", args.model, "--port", str(port),
               "--max-batch", str(args.max_batch)] + (["--threads", str(args.threads)] if args.threads else []) + (
               ["--dtype", args.dtype] if args.dtype else [])
    rows: list[dict[str, float]] = []
    with harness.running(command, f"http://127.0.0.1:{port}/health", timeout=args.timeout, stop=signal.SIGINT) as server:
        name = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["model"]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
        one(client, name, "Hi", 4, args.endpoint)  # warm-up
        if args.churn:
            churn(client, name, server.pid, max(args.clients), args.churn, args.max_tokens, args.endpoint)
        else:
            rows = table(client, name, args)
        occupancy = [line for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
                     if line.startswith("qkv_batch_occupancy ")]
        print(occupancy[0])
    if args.json and rows:
        harness.write_json(args.json, {"model": args.model, "endpoint": args.endpoint, "requests": args.requests,
                                       "max_tokens": args.max_tokens, "runs": rows, "occupancy_after": occupancy[0]},
                           facts)
    return 0


def table(client: OpenAI, name: str, args: argparse.Namespace) -> list[dict[str, float]]:
    print("| clients | tokens | seconds | tokens/s | TTFT p50 / p95 (s) | inter-token p50 / p95 (ms) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for clients in args.clients:
        r = run(client, name, clients, args.requests, args.max_tokens, args.endpoint)
        rows.append(r)
        print(f"| {clients} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | {1000 * r['itl_p50']:.0f} / {1000 * r['itl_p95']:.0f} |",
              flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
