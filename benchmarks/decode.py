"""Decode speed of qkv against transformers on the same GPT-2-124M-shaped random checkpoint.

    .venv/bin/python benchmarks/decode.py [--repeats 3] [--new-tokens 128] [--prompt-tokens 64]

transformers builds a random GPT2LMHeadModel (the 124M shape), saves it to a temporary
folder, and both libraries load that folder. For each dtype (float32, bfloat16) and each
mode (KV cache, no cache) the two contenders alternate round by round; the table shows
median tokens/s (new tokens / wall time of the whole generate call, prefill included)
and the qkv/transformers ratio from the same run. Greedy decoding, batch 1. It also
prints the KV-cache bytes of multi-head vs grouped-query configs (real KVCache modules).

Shape legend: B batch (1), T prompt tokens, N new tokens, S cache positions.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, models

import qkv
from qkv.attention.kv_cache import KVCache
from qkv.models.llama_config import PRESETS as LLAMA_PRESETS
from qkv.models.qwen import PRESETS as QWEN_PRESETS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_checkpoint(folder: Path, seed: int) -> None:
    """A random GPT-2-124M-shaped checkpoint as transformers saves it, with a tokenizer.json."""
    import transformers

    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(folder)
    # The benchmark feeds token ids directly; load_pretrained still wants a tokenizer file.
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def compare(folder: Path, dtype_name: str, args: argparse.Namespace) -> list[dict[str, object]]:
    """Median tokens/s of qkv.generate and transformers' generate, alternating, same prompt,
    with the KV cache and (unless skipped) without it."""
    import transformers

    dtype = DTYPES[dtype_name]
    ours, _ = qkv.load_pretrained(folder, dtype=dtype)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype).eval()
    prompt = torch.randint(0, 50257, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens

    def contenders(use_cache: bool) -> dict[str, Callable[[], torch.Tensor]]:
        def run_qkv() -> torch.Tensor:
            return qkv.generate(ours, prompt, n, use_cache=use_cache)

        def run_hf() -> torch.Tensor:
            with torch.inference_mode():
                return theirs.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, use_cache=use_cache, pad_token_id=0,
                )

        return {"qkv": run_qkv, "transformers": run_hf}

    for fn in contenders(True).values():
        fn()  # warm-up: first calls pay for lazy initialisation
    rows = []
    for use_cache in ([True] if args.skip_no_cache else [True, False]):
        times: dict[str, list[float]] = {"qkv": [], "transformers": []}
        outputs: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats if use_cache else args.no_cache_repeats):
            for name, fn in contenders(use_cache).items():
                seconds, outputs[name] = timed(fn)
                times[name].append(seconds)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({
            "dtype": dtype_name,
            "mode": "KV cache" if use_cache else "no cache",
            "qkv": n / med["qkv"],
            "transformers": n / med["transformers"],
            "ratio": med["transformers"] / med["qkv"],
            "same_tokens": bool(torch.equal(outputs["qkv"], outputs["transformers"])),
            "runs": len(times["qkv"]),
        })
        r = rows[-1]
        print(f"  measured {r['dtype']} {r['mode']}: qkv {r['qkv']:.1f}, transformers {r['transformers']:.1f} tokens/s",
              flush=True)
    return rows


def kv_cache_rows(positions: int) -> list[tuple[str, str, int, int, int, int]]:
    """(model, attention, layers, H_kv, D, bytes) at `positions` tokens, batch 1, bfloat16."""
    shapes = [("GPT-2 124M", 12, 12, 12, 64)]  # name, layers, H, H_kv, D
    for name, cfg in {**LLAMA_PRESETS, **QWEN_PRESETS}.items():
        shapes.append((name, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim))
    rows = []
    for name, layers, heads, kv_heads, head_dim in shapes:
        for label, h_kv in (("multi-head", heads), ("grouped-query", kv_heads)):
            if label == "grouped-query" and h_kv == heads:
                continue
            cache = KVCache(1, h_kv, positions, head_dim, dtype=torch.bfloat16)
            rows.append((name, f"{label} ({heads}/{h_kv})", layers, h_kv, head_dim, layers * cache.nbytes))
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"{cpu}; {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"load average at the end {load}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender with the cache")
    parser.add_argument("--no-cache-repeats", type=int, default=1,
                        help="timed runs without the cache (each reruns the prefix for every token)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--skip-no-cache", action="store_true")
    parser.add_argument("--kv-positions", type=int, default=2048)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, seed=0)
        for dtype_name in args.dtypes:
            rows += compare(folder, dtype_name, args)

    print(f"\nGPT-2-124M-shaped random weights, batch 1, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} greedy new tokens (tokens/s = new tokens / whole generate call)\n")
    print("| dtype | mode | qkv tokens/s | transformers tokens/s | qkv / transformers | same tokens | runs |")
    print("|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['mode']} | {r['qkv']:.1f} | {r['transformers']:.1f} | {r['ratio']:.2f}x | "
              f"{'yes' if r['same_tokens'] else 'no'} | {r['runs']} |")
    print(f"\nKV-cache bytes at {args.kv_positions} positions, batch 1, bfloat16\n")
    print("| model shape | attention (H/H_kv) | layers | H_kv | D | KV-cache MiB |")
    print("|---|---|---:|---:|---:|---:|")
    for name, label, layers, h_kv, d, nbytes in kv_cache_rows(args.kv_positions):
        print(f"| {name} | {label} | {layers} | {h_kv} | {d} | {nbytes / 2**20:.0f} |")
    print(f"\nMachine: {machine()}")


if __name__ == "__main__":
    main()
