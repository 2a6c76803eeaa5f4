"""lm-evaluation-harness against `qkv serve`, checked item by item (issue 25).

Starts `qkv serve --dtype float32` on SmolLM2 (the checkpoint's numbers, as the direct
scoring and transformers use them), runs lm-eval 0.4's `local-completions` model on the
multiple-choice task in benchmarks/quality/lm_eval_task (tokens counted by the server's own
tokenizer: `tokenizer_backend=remote`, so lm-eval sends lists of token-id prompts with echo
and reads back each prompt token's logprob), then scores every (context, continuation) pair
again directly with qkv (one forward pass, no server, no cache) and, with --hf, with
lm-eval's own `hf` backend (transformers reading the same GGUF). Prints the accuracy and
the largest per-item differences; --json writes them (atomically, with the machine's facts:
benchmarks/harness.py, which also starts and stops the server).

    python benchmarks/quality/lm_eval_check.py --threads 1 [--hf [--hf-limit 10]] [--json benchmarks/quality/lm_eval_check.json]
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent  # lm_eval_task/ is beside this file
TASK = "qkv_verdict_next"


def lm_eval(model: str, model_args: str, out: Path, extra: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """Run lm-eval; returns its logged samples (one per item)."""
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
               "--tasks", TASK, "--include_path", str(HERE / "lm_eval_task"), "--output_path", str(out),
               "--log_samples", *extra]
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    print(f"lm-eval {model}: {time.perf_counter() - started:.1f} s", flush=True)
    files = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    samples = [json.loads(line) for line in Path(sorted(files)[-1]).read_text().splitlines() if line.strip()]
    return sorted(samples, key=lambda s: s["doc_id"])


def pairs_and_scores(samples: list[dict]) -> tuple[list[list[tuple[str, str]]], list[list[float]]]:
    pairs = [[(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()] for s in samples]
    scores = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return pairs, scores


def direct_scores(pairs: list[list[tuple[str, str]]]) -> list[list[float]]:
    """Each continuation's log-likelihood by qkv's model directly, tokenized as lm-eval
    tokenizes it (the whole text encoded, the context's tokens split off the front)."""
    from qkv.models.loader import load_pretrained

    model, tokenizer = load_pretrained("smollm2")
    out = []
    for i, item in enumerate(pairs):
        rows = []
        for context, continuation in item:
            spaces = len(context) - len(context.rstrip())  # lm-eval moves trailing spaces onto the continuation
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
            rows.append((whole, len(tokenizer.encode(context, add_special_tokens=False).ids)))
        # The item's choices in one batch, padded at the end: a causal model's logits at the
        # real positions do not see the padding after them.
        longest = max(len(whole) for whole, _ in rows)
        ids = torch.tensor([whole + [0] * (longest - len(whole)) for whole, _ in rows])  # (choices, T)
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(ids).float(), dim=-1)  # (choices, T, V)
        scores = []
        for r, (whole, n_context) in enumerate(rows):
            targets = torch.tensor(whole[n_context:])
            scores.append(float(logprobs[r, n_context - 1: len(whole) - 1].gather(1, targets[:, None]).sum()))
        out.append(scores)
        if (i + 1) % 10 == 0:
            print(f"scored {i + 1}/{len(pairs)} items directly", flush=True)
    return out


def accuracy(scores: list[list[float]], samples: list[dict]) -> float:
    right = [max(range(len(s)), key=s.__getitem__) == sample["doc"]["label"] for s, sample in zip(scores, samples)]
    return sum(right) / len(right)


def largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request lm-eval sends")
    parser.add_argument("--hf", action="store_true", help="also run lm-eval's hf backend on the same GGUF")
    parser.add_argument("--hf-limit", type=int, help="items the hf backend scores (default: all)")
    args = parser.parse_args()
    from qkv.util.threads import apply_threads

    apply_threads(args.threads)  # this process scores directly after the server has stopped
    facts = harness.header("lm-evaluation-harness against qkv serve, item by item", packages=("lm_eval",))
    port = harness.free_port()
    env = {**os.environ, "OPENAI_API_KEY": "unused"}
    command = [sys.executable, "-m", "qkv", "serve", "--model", "smollm2", "--port", str(port),
               "--threads", str(args.threads), "--max-batch", "8", "--dtype", "float32"]
    results: dict[str, object] = {}
    with harness.running(command, f"http://127.0.0.1:{port}/health", timeout=300, env=env, stdout=None) as server:
        with tempfile.TemporaryDirectory() as tmp:
            samples = lm_eval(
                "local-completions",
                f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
                "num_concurrent=1,max_retries=1", Path(tmp) / "serve", ["--batch_size", str(args.batch_size)])
            server.terminate()
            server.wait(30)
            pairs, served = pairs_and_scores(samples)
            direct = direct_scores(pairs)
            results = {"items": len(samples), "choices": sum(map(len, pairs)),
                       "accuracy_lm_eval_on_qkv_serve": accuracy(served, samples),
                       "accuracy_qkv_direct": accuracy(direct, samples),
                       "max_abs_diff_serve_vs_direct": largest_difference(served, direct),
                       "per_item": [{"served": a, "direct": b} for a, b in zip(served, direct)]}
            if args.json:
                harness.write_json(args.json, results, facts)
            print({k: v for k, v in results.items() if k != "per_item"}, flush=True)
            if args.hf:
                from qkv.models.loader import smollm2_path

                gguf = smollm2_path()
                folder = Path(tmp) / "hf"
                folder.mkdir()
                (folder / gguf.name).symlink_to(gguf)
                limit = ["--limit", str(args.hf_limit)] if args.hf_limit else []
                hf = lm_eval("hf", f"pretrained={folder},gguf_file={gguf.name},dtype=float32",
                             Path(tmp) / "hf-out", ["--device", "cpu", "--batch_size", "4", *limit],
                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                hf_pairs, hf_scores = pairs_and_scores(hf)
                results["hf_items"] = len(hf)
                results["hf_same_requests"] = hf_pairs == pairs[: len(hf)]
                results["accuracy_lm_eval_hf"] = accuracy(hf_scores, hf)
                results["max_abs_diff_serve_vs_hf"] = largest_difference(served[: len(hf)], hf_scores)
    print(json.dumps({k: v for k, v in results.items() if k != "per_item"}, indent=2))
    if args.json:
        harness.write_json(args.json, results, facts)


if __name__ == "__main__":
    main()
