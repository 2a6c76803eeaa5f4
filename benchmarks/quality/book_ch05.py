"""The book's chapter-5 training run, twice on this machine: the book's own code and
`qkv train --preset book`. Losses at every evaluation, time per step, peak memory.

    git clone https://github.com/rasbt/LLMs-from-scratch /tmp/LLMs-from-scratch
    .venv/bin/python benchmarks/quality/book_ch05.py --book-code /tmp/LLMs-from-scratch/ch05/01_main-chapter-code \
        --data ../shared/data/the-verdict.txt --json /tmp/book_ch05.json

The book's code runs as its notebook (ch05.ipynb, section 5.2) runs it: GPT_CONFIG_124M with
context 256, torch.manual_seed(123) before the loaders and again before GPTModel, AdamW lr 4e-4
weight decay 0.1, 10 epochs, eval_freq 5, eval_iter 5. Its tiktoken.get_encoding("gpt2") is
given tiktoken's gpt2 encoding built offline from the rank file qkv reads (no download). Each
run is its own process (peak RSS is the process's); both use the same number of torch threads.
Two runs, not rounds: --parallel runs them side by side so that both see the same load. The
JSON is written atomically with the machine's facts (benchmarks/harness.py).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

LINE = re.compile(r"Ep (\d+) \(Step (\d+)\): Train loss ([0-9.]+), Val loss ([0-9.]+)")


def run_book(book_code: str, data: str, epochs: int, threads: int) -> dict:
    import tiktoken
    import torch
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    from qkv.models.hf.gpt2_tokenizer import ranks_path

    torch.set_num_threads(threads)
    encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=load_tiktoken_bpe(str(ranks_path())),
                                 special_tokens={"<|endoftext|>": 50256})
    tiktoken.get_encoding = lambda name: encoding
    sys.path.insert(0, book_code)
    import gpt_train
    from previous_chapters import GPTModel, create_dataloader_v1

    cfg = {"vocab_size": 50257, "context_length": 256, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
           "drop_rate": 0.1, "qkv_bias": False}
    text = Path(data).read_text(encoding="utf-8")
    split_idx = int(0.90 * len(text))
    torch.manual_seed(123)
    train_loader = create_dataloader_v1(text[:split_idx], batch_size=2, max_length=256, stride=256,
                                        drop_last=True, shuffle=True, num_workers=0)
    val_loader = create_dataloader_v1(text[split_idx:], batch_size=2, max_length=256, stride=256,
                                      drop_last=False, shuffle=False, num_workers=0)
    torch.manual_seed(123)
    model = GPTModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1)
    start = time.perf_counter()
    train_losses, val_losses, tokens_seen = gpt_train.train_model_simple(
        model, train_loader, val_loader, optimizer, torch.device("cpu"), num_epochs=epochs, eval_freq=5,
        eval_iter=5, start_context="Every effort moves you", tokenizer=encoding)
    seconds = time.perf_counter() - start
    return {"train_losses": train_losses, "val_losses": val_losses, "tokens_seen": tokens_seen,
            "seconds": seconds, "steps": epochs * len(train_loader),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_qkv(data: str, epochs: int, threads: int, out: str, plot: str | None) -> dict:
    report = ("import resource, sys; from qkv.cli.main import main; code = main(sys.argv[1:]); "
              "print('PEAK_RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr); "
              "sys.exit(code)")
    command = [sys.executable, "-c", report, "train", "--preset", "book", "--data", data, "--out", out,
               "--epochs", str(epochs), "--threads", str(threads), "--overwrite", *(["--plot", plot] if plot else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    sys.stdout.write(done.stdout)
    rows = [tuple(float(g) for g in m.groups()) for m in LINE.finditer(done.stdout)]
    folder = Path(out)
    summary = re.search(r"(\d+) steps, [0-9,]+ tokens in ([0-9.]+) s", done.stdout)
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    records = [m for m in metrics if "train_loss" in m]  # full precision (the printed lines have 3 decimals)
    assert len(records) == len(rows)
    return {"train_losses": [m["train_loss"] for m in records], "val_losses": [m["val_loss"] for m in records],
            "seconds": float(summary.group(2)), "steps": int(summary.group(1)),
            "peak_rss_bytes": int(re.search(r"PEAK_RSS (\d+)", done.stderr).group(1)),
            "folder_bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
            "metrics": metrics}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--book-code", required=True, help="LLMs-from-scratch/ch05/01_main-chapter-code")
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--which", choices=("both", "book", "qkv"), default="both")
    parser.add_argument("--out", default=None, help="qkv's output folder (default: a temporary one)")
    parser.add_argument("--plot", default=None, help="qkv's --plot FILE (figure 5.12)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--parallel", action="store_true",
                        help="run the two at the same time (on a busy machine: both see the same load)")
    args = parser.parse_args()
    if args.which == "book":  # the child process
        print(json.dumps(run_book(args.book_code, args.data, args.epochs, args.threads)), file=sys.stderr)
        return
    facts = harness.header("the book's chapter-5 run: its own code beside `qkv train --preset book`")
    results: dict = {"threads": args.threads, "epochs": args.epochs, "parallel": args.parallel,
                     "load_before": os.getloadavg()}
    child = None
    if args.which == "both":
        child = subprocess.Popen([sys.executable, __file__, "--which", "book", "--book-code", args.book_code,
                                  "--data", args.data, "--epochs", str(args.epochs), "--threads", str(args.threads),
                                  "--json", "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not args.parallel:
            child.wait()
    with tempfile.TemporaryDirectory() as tmp:
        results["qkv"] = run_qkv(args.data, args.epochs, args.threads, args.out or tmp, args.plot)
    if child is not None:
        out, err = child.communicate()
        sys.stdout.write(out)
        if child.returncode != 0:
            raise SystemExit(f"the book's run failed:\n{err[-2000:]}")
        results["book"] = json.loads(err.strip().splitlines()[-1])
    results["load_after"] = os.getloadavg()
    if "book" in results:
        book, ours = results["book"], results["qkv"]
        results["max_abs_diff"] = [max(abs(a - b), abs(c - d)) for a, b, c, d in
                                   zip(book["train_losses"], ours["train_losses"], book["val_losses"], ours["val_losses"])]
        results["time_per_step_ratio"] = (ours["seconds"] / ours["steps"]) / (book["seconds"] / book["steps"])
    harness.write_json(args.json, results, facts)
    print(json.dumps({k: v for k, v in results.items() if k not in ("book", "qkv")}, indent=1))


if __name__ == "__main__":
    main()
