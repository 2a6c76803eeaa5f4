"""What a megabyte prompt does to everyone else on `qkv serve`, and what the defensive JSON
parser costs (issue 28), on loopback only.

    python benchmarks/serve_front_door.py --model smollm2 --runs 3
    python benchmarks/serve_front_door.py --model smollm2 --src /path/to/other/src   # another tree

Starts `qkv serve` as a subprocess (with PYTHONPATH=--src, default this tree's src) on a free
127.0.0.1 port. Each run streams one chat answer (greedy, 160 tokens); once its first token is
in, it posts a prompt of just under 1 MiB (answered 400: it exceeds the context, after being
tokenized) and meanwhile probes /health every 20 ms. It reports, as medians over runs: the
slowest /health answer while the prompt was prepared, the longest gap between two tokens of
the stream, and the prompt's own answer time. Then, in this process, the median time of
json.loads and of qkv's parse_json on a 1 MiB body. The server is stopped at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The cat sat on the mat and looked at the keys. " * 22_000)[: (1 << 20) - 300]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream_gaps(url: str, model: str, first: threading.Event) -> list[float]:
    stamps: list[float] = []
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a story about a small robot."}],
            "max_tokens": 160, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                stamps.append(time.perf_counter())
                first.set()
    first.set()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def one_run(url: str, model: str) -> tuple[float, float, float]:
    first = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(_stream_gaps, url, model, first)
        first.wait(300)
        start = time.perf_counter()
        big = pool.submit(httpx.post, url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4},
                          timeout=300)
        health: list[float] = []
        while not big.done():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=60)
            health.append(time.perf_counter() - t)
            time.sleep(0.02)
        answered = time.perf_counter() - start
        status = big.result().status_code
        gaps = stream.result()
    if status != 400:
        raise SystemExit(f"the megabyte prompt was answered {status}, not 400")
    return max(health, default=float("nan")), max(gaps, default=float("nan")), answered


def parse_cost() -> tuple[float, float]:
    sys.path.insert(0, str(ROOT / "src"))
    from qkv.serve.api.json_body import parse_json

    raw = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 4}).encode()
    loads, ours = [], []
    for _ in range(20):
        t = time.perf_counter()
        json.loads(raw)
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        parse_json(raw)
        ours.append(time.perf_counter() - t)
    return statistics.median(loads), statistics.median(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--src", default=str(ROOT / "src"), help="the qkv sources the server runs (PYTHONPATH)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": args.src}
    server = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--model", args.model, "--port", str(port),
                               "--max-batch", "2", "--context", "256", "--threads", str(args.threads)],
                              stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                model = httpx.get(url + "/v1/models", timeout=2).json()["data"][0]["id"]
                break
            except (httpx.TransportError, KeyError, ValueError):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.2)
        runs = [one_run(url, model) for _ in range(args.runs)]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    health, gap, answered = (statistics.median(values) for values in zip(*runs))
    print(f"sources {args.src}, model {args.model}, {args.runs} runs (medians)")
    print(f"  slowest /health during a 1 MiB prompt: {health * 1000:.0f} ms")
    print(f"  longest gap between two streamed tokens meanwhile: {gap * 1000:.0f} ms")
    print(f"  the 1 MiB prompt answered (400, over the context) in {answered:.2f} s")
    loads, ours = parse_cost()
    print(f"  1 MiB body: json.loads {loads * 1000:.1f} ms, parse_json {ours * 1000:.1f} ms ({ours / loads:.2f}x)")


if __name__ == "__main__":
    main()
