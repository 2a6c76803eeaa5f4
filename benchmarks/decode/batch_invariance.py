"""Batch invariance on the real SmolLM2 (issue 23's target), end to end through the commands.

For each precision (the default and int8): start `qkv serve`, send 8 different chat prompts
at once (temperature 0, 64 tokens), then each alone, then each alone again after explorer
traces (with generation) ran on the same server; and run `qkv generate --chat` on each.
Every answer must be the same token for token. Prints a table and exits 1 on a mismatch.

    .venv/bin/python benchmarks/decode/batch_invariance.py [--precisions auto int8] [--tokens 64] [--json PATH]

The server binds 127.0.0.1 on a free port and is always stopped (benchmarks/harness.py's
`running`). Nothing is timed: the machine's facts head the output for the record.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

PROMPTS = [
    "Count to ten: one, two,",
    "Explain photosynthesis.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a key.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
]


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _chat(port: int, prompt: str, tokens: int) -> str:
    answer = _post(port, "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": tokens})
    return answer["choices"][0]["message"]["content"]


@contextlib.contextmanager
def _serve(precision: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "qkv", "serve", "--model", "smollm2", "--port", str(port), "--dtype", precision]
    with harness.running(command, f"http://127.0.0.1:{port}/health", timeout=300, stderr=subprocess.PIPE) as server:
        yield server


def _generate(precision: str, prompt: str, tokens: int) -> str:
    out = subprocess.run([sys.executable, "-m", "qkv", "generate", "--model", "smollm2", "--chat", "--prompt", prompt,
                          "--max-new-tokens", str(tokens), "--temperature", "0", "--dtype", precision],
                         capture_output=True, text=True, timeout=600, check=True)
    return out.stdout.strip()


def run(precision: str, tokens: int) -> dict[str, list[bool]]:
    port = harness.free_port()
    with _serve(precision, port):
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: _chat(port, p, tokens), PROMPTS))
        alone = [_chat(port, p, tokens) for p in PROMPTS]
        for prompt in PROMPTS[:3]:  # explorer traces on the same model, with generation
            _post(port, "/explorer/trace", {"text": prompt, "layer": 3, "head": 1, "generate": 4})
        after = [_chat(port, p, tokens) for p in PROMPTS]
    generated = [_generate(precision, p, tokens) for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        if len({together[i], alone[i], after[i], generated[i].strip()}) > 1:
            print(f"  differs on {prompt!r}:\n    together {together[i]!r}\n    alone    {alone[i]!r}\n"
                  f"    after    {after[i]!r}\n    generate {generated[i]!r}", file=sys.stderr)
    return {
        "8 at once == alone": [a == b for a, b in zip(together, alone)],
        "alone after explorer traces == alone": [a == b for a, b in zip(after, alone)],
        "qkv generate --chat == alone": [g.strip() == a.strip() for g, a in zip(generated, alone)],
    }


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--precisions", nargs="+", default=["auto", "int8"])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    facts = harness.header("batch invariance on SmolLM2 through qkv serve and qkv generate")
    print(f"machine: {facts['logical cpus']} cores; {args.tokens} greedy tokens, {len(PROMPTS)} prompts")
    failed = False
    table: dict[str, dict[str, list[bool]]] = {}
    for precision in args.precisions:
        results = table[precision] = run(precision, args.tokens)
        for check, equal in results.items():
            print(f"{precision:>8}  {check:<40} {sum(equal)}/{len(equal)} equal")
            failed |= not all(equal)
    if args.json:
        harness.write_json(args.json, {"tokens": args.tokens, "prompts": PROMPTS, "equal": table}, facts)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
