"""Do running streams keep flowing while `qkv serve` takes a long prompt, and does a short
prompt sent just after it wait for it?

    python benchmarks/serve/long_prompt_streams.py --streams 6 --long-tokens 2700 [--json PATH]
    python benchmarks/serve/long_prompt_streams.py --streams 7 --max-batch 9 --long-tokens 4000

Starts `qkv serve --max-batch N --context C` (--max-batch, default 8; --context, default
4096) on a free 127.0.0.1 port, opens --streams (at most N - 2, so that the long and the
short chat find a free slot each) greedy streamed chats of --stream-tokens tokens, and once
every one has its first token,
sends one chat of about --long-tokens prompt tokens and, --short-after seconds later, a
short chat. Reported: the long and the short request's time to first token, and the
streams' inter-token gaps while the long prompt was being prefilled (from its sending to its
first token): p50, p99 and the largest, against the streams' p50 gap before it came. The
prefill of the long prompt in pieces between decode steps (qkv.serve.engine.prefill) is what
this measures; run it with another PYTHONPATH to measure another engine.
"""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import threading
import time
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from serve_load import PROMPTS, _percentile  # noqa: E402

FILLER = "Keys are compared with queries, and the values of the keys that match are mixed. "


def stream(client: OpenAI, model: str, prompt: str, max_tokens: int, stamps: list[float],
           first: threading.Event | None = None) -> None:
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            if first is not None and len(stamps) == 1:
                first.set()


def main() -> int:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--streams", type=int, default=6, help="running streams, at most --max-batch - 2")
    parser.add_argument("--max-batch", type=int, default=8, help="the server's slots (default: %(default)s)")
    parser.add_argument("--context", type=int, default=4096, help="the server's context (default: %(default)s)")
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--long-tokens", type=int, default=2700, help="about this many prompt tokens")
    parser.add_argument("--short-after", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if not 1 <= args.streams <= args.max_batch - 2:
        parser.error(f"--streams must be 1..{args.max_batch - 2} (--max-batch less the long and the short chat)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    facts = harness.header("running streams beside a long prompt, qkv serve")
    from qkv.models.loader import open_model, smollm2_path

    tokenizer = open_model("smollm2").source.tokenizer
    per = len(tokenizer.encode(FILLER * 2).ids) - len(tokenizer.encode(FILLER).ids)  # what one more repeat adds
    long_prompt = FILLER * max(1, args.long_tokens // per) + "Summarize this in one line."
    port = harness.free_port()
    command = [sys.executable, "-m", "qkv", "serve", "--model", str(smollm2_path()), "--port", str(port),
               "--max-batch", str(args.max_batch), "--context", str(args.context), "--threads", str(args.threads)]
    with harness.running(command, f"http://127.0.0.1:{port}/health", timeout=args.timeout):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
        model = client.models.list().data[0].id
        stream(client, model, "Hi", 4, [])  # warm-up
        stamps: list[list[float]] = [[] for _ in range(args.streams)]
        firsts = [threading.Event() for _ in range(args.streams)]
        long_stamps: list[float] = []
        short_stamps: list[float] = []
        with concurrent.futures.ThreadPoolExecutor(args.streams + 2) as pool:
            running = [pool.submit(stream, client, model, PROMPTS[i % len(PROMPTS)], args.stream_tokens, stamps[i],
                                   firsts[i]) for i in range(args.streams)]
            for event in firsts:
                event.wait(args.timeout)
            time.sleep(1.0)  # a second of steady streaming before the long prompt
            long_sent = time.perf_counter()
            long_job = pool.submit(stream, client, model, long_prompt, 8, long_stamps)
            time.sleep(args.short_after)
            short_sent = time.perf_counter()
            short_job = pool.submit(stream, client, model, "What is softmax?", 8, short_stamps)
            for job in (*running, long_job, short_job):
                job.result(args.timeout)
    long_first = long_stamps[0] if long_stamps else float("nan")
    during = [b - a for s in stamps for a, b in zip(s, s[1:]) if long_sent <= b and a <= long_first]
    steady = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < long_sent]
    result = {
        "long_prompt_tokens": len(tokenizer.encode(long_prompt).ids),
        "long_ttft_s": long_first - long_sent,
        "short_ttft_s": (short_stamps[0] - short_sent) if short_stamps else float("nan"),
        "gap_p50_before_s": _percentile(steady, 0.5),
        "gap_p50_during_s": _percentile(during, 0.5), "gap_p99_during_s": _percentile(during, 0.99),
        "gap_max_during_s": max(during, default=float("nan")), "gaps_during": len(during),
    }
    for key, value in result.items():
        print(f"{key:>20}: {value:.3f}" if isinstance(value, float) else f"{key:>20}: {value}")
    if args.json:
        harness.write_json(args.json, {"command": command, **result}, facts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
