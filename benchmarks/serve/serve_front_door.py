"""What a megabyte prompt does to everyone else on `qkv serve`, and what the defensive JSON
parser costs (issue 28), on loopback only.

    python benchmarks/serve/serve_front_door.py --model smollm2 --runs 3 [--json PATH]
    python benchmarks/serve/serve_front_door.py --model smollm2 --src /path/to/other/src   # another tree

Starts `qkv serve` as a subprocess (with PYTHONPATH=--src, default this tree's src) on a free
127.0.0.1 port. Each run streams one chat answer (greedy, 160 tokens); once its first token is
in, it posts a prompt of just under 1 MiB (answered 400: it exceeds the context, after being
tokenized) and meanwhile probes /health every 20 ms. It reports, as medians over runs: the
slowest /health answer while the prompt was prepared, the longest gap between two tokens of
the stream, and the prompt's own answer time. Then, in this process, the median time of
json.loads and of qkv's parse_json on a 1 MiB body, the two alternating (benchmarks/harness.py:
qkv.bench.measure.timing's `alternate`, 20 rounds). The server is stopped at the end.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

PROMPT = ("The cat sat on the mat and looked at the keys. " * 22_000)[: (1 << 20) - 300]


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


def parse_cost() -> dict[str, harness.Measurement]:
    sys.path.insert(0, str(harness.SRC))
    from qkv.serve.api.json_body import parse_json

    raw = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 4}).encode()
    return harness.alternate({"json.loads": lambda: json.loads(raw), "parse_json": lambda: parse_json(raw)},
                             work=1, unit="bodies", repeats=20, warmup=0)


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--src", default=str(harness.SRC), help="the qkv sources the server runs (PYTHONPATH)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    facts = harness.header("qkv serve's front door: a 1 MiB prompt and everyone else")
    port = harness.free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": args.src}
    command = [sys.executable, "-m", "qkv", "serve", "--model", args.model, "--port", str(port),
               "--max-batch", "2", "--context", "256", "--threads", str(args.threads)]
    with harness.running(command, url + "/v1/models", timeout=300, env=env, stop=signal.SIGINT, stop_timeout=60):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        runs = [dict(zip(("health_s", "gap_s", "answered_s"), one_run(url, model))) for _ in range(args.runs)]
    medians = harness.median_of_each(runs)  # one contender, --runs runs: nothing to alternate with
    health, gap, answered = medians["health_s"], medians["gap_s"], medians["answered_s"]
    print(f"sources {args.src}, model {args.model}, {args.runs} runs (medians)")
    print(f"  slowest /health during a 1 MiB prompt: {health * 1000:.0f} ms")
    print(f"  longest gap between two streamed tokens meanwhile: {gap * 1000:.0f} ms")
    print(f"  the 1 MiB prompt answered (400, over the context) in {answered:.2f} s")
    parsed = parse_cost()
    loads, ours = parsed["json.loads"].median_s, parsed["parse_json"].median_s
    # parse_json's time over json.loads': the inverse of harness.ratio's rate over rate
    print(f"  1 MiB body: json.loads {loads * 1000:.1f} ms, parse_json {ours * 1000:.1f} ms "
          f"({1 / harness.ratio(parsed['parse_json'], parsed['json.loads']).value:.2f}x)")
    if args.json:
        harness.write_json(args.json, {"sources": args.src, "model": args.model, "runs": runs, "medians": medians,
                                       "parse": harness.summary(parsed.values())}, facts)


if __name__ == "__main__":
    main()
