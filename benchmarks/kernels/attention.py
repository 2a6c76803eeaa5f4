"""Attention speed and memory: qkv's explicit and fused kernels against raw PyTorch.

Contenders, forward pass only, eval mode, no grad, causal self-attention:
- kernels on already projected q, k, v of shape (B, H, T, D): raw
  `torch.nn.functional.scaled_dot_product_attention`, `qkv.attention.fused_attention`,
  `qkv.attention.explicit_attention`; once with `is_causal` only and once with a causal +
  key-padding mask (raw SDPA gets the combined mask prebuilt, and once builds it per call
  as qkv must);
- modules on x of shape (B, T, C): `torch.nn.MultiheadAttention`, the book's
  `MultiHeadAttention` as it is (explicit path), `GroupedQueryAttention` (fused, explicit);
- the causal kernels alone from 512 to 4096 tokens.

Times are medians of --rounds runs (benchmarks/harness.py: qkv.bench.measure.timing's
`alternate`), the contenders of a group alternating within each round, who goes first
rotating, so that a noisy neighbour hurts all of them alike; a ratio is the median over
rounds of (contender / raw SDPA in the same round). Peak memory is measured, not estimated: each
contender runs once in a fresh subprocess, which reports its peak resident set size
(VmHWM, reset just before the call) minus its resident size just before the call. The "T×S matrix" column gives the bytes of
one (B, H, T, S) float32 score matrix, which the explicit path materialises several times.

Shape legend: B batch, T tokens (queries = keys), C embedding, H heads, D head size.

    python benchmarks/kernels/attention.py            # the full run (a few minutes on 2 cores)
    python benchmarks/kernels/attention.py --quick    # a smoke run of every code path
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.attention import GroupedQueryAttention, causal_mask, explicit_attention, fused_attention, padding_mask  # noqa: E402
from qkv.book import MultiHeadAttention  # noqa: E402


@dataclass(frozen=True)
class Size:
    batch: int
    tokens: int
    emb_dim: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.heads

    def label(self) -> str:
        return f"B={self.batch} T={self.tokens} C={self.emb_dim} H={self.heads}"


FULL_BOOK = Size(batch=8, tokens=1024, emb_dim=768, heads=12)
FULL_SWEEP = (512, 1024, 2048, 4096)
SWEEP_BATCH = 1
QUICK_BOOK = Size(batch=2, tokens=128, emb_dim=64, heads=4)
QUICK_SWEEP = (64, 128)

GROUPS = ("kernels", "kernels_masked", "modules", "sweep")
REFERENCE = "raw SDPA"


def _qkv_tensors(size: Size, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (size.batch, size.heads, size.tokens, size.head_dim)  # (B, H, T, D)
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))  # type: ignore[return-value]


def _key_padding(size: Size) -> Tensor:
    """(B, S): every other sequence ends with 1/8 of its keys padded."""
    real = torch.ones(size.batch, size.tokens, dtype=torch.bool)
    real[::2, size.tokens - size.tokens // 8 :] = False
    return real


def build_group(group: str, size: Size, seed: int = 0) -> dict[str, Callable[[], Tensor]]:
    """The contenders of one group, as zero-argument calls on inputs built here once."""
    if group in ("kernels", "sweep"):
        q, k, v = _qkv_tensors(size, seed)
        return {
            REFERENCE: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "qkv fused": lambda: fused_attention(q, k, v, is_causal=True),
            "qkv explicit": lambda: explicit_attention(q, k, v, is_causal=True)[0],
        }
    if group == "kernels_masked":
        q, k, v = _qkv_tensors(size, seed)
        real = _key_padding(size)
        combined = causal_mask(size.tokens) & padding_mask(real)  # (B, 1, T, S), prebuilt
        pad = padding_mask(real)  # (B, 1, 1, S)
        return {
            REFERENCE: lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=combined),
            "raw SDPA, mask built per call": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_mask(size.tokens) & pad
            ),
            "qkv fused": lambda: fused_attention(q, k, v, mask=pad, is_causal=True),
            "qkv explicit": lambda: explicit_attention(q, k, v, mask=pad, is_causal=True)[0],
        }
    if group == "modules":
        torch.manual_seed(seed)
        c, h, t = size.emb_dim, size.heads, size.tokens
        q, k, v = _qkv_tensors(size, seed)
        x = torch.randn(size.batch, t, c)  # (B, T, C)
        torch_mha = nn.MultiheadAttention(c, h, batch_first=True).eval()
        hidden = ~causal_mask(t)  # torch's convention: True = may not attend
        book = MultiHeadAttention(c, c, context_length=t, dropout=0.0, num_heads=h).eval()
        gqa_fused = GroupedQueryAttention(c, h, qkv_bias=True, out_bias=True, backend="fused").eval()
        gqa_explicit = GroupedQueryAttention(c, h, qkv_bias=True, out_bias=True, backend="explicit").eval()
        return {
            REFERENCE: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "nn.MultiheadAttention": lambda: torch_mha(
                x, x, x, attn_mask=hidden, is_causal=True, need_weights=False
            )[0],
            "book MultiHeadAttention": lambda: book(x),
            "GroupedQueryAttention fused": lambda: gqa_fused(x),
            "GroupedQueryAttention explicit": lambda: gqa_explicit(x),
        }
    raise ValueError(f"unknown group {group!r}; choose one of {', '.join(GROUPS)}")


def time_group(contenders: dict[str, Callable[[], Tensor]], repeats: int) -> dict[str, harness.Measurement]:
    """Seconds per call, contenders alternating within each round, after one warm-up call each."""
    with torch.inference_mode():
        return harness.alternate(contenders, work=1, unit="calls", repeats=repeats, warmup=1)


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (resident peak) of this process, from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_child(group: str, size: Size, name: str) -> None:
    """Runs in a fresh interpreter: peak RSS growth caused by one call of one contender.

    Not getrusage's ru_maxrss: Linux carries it over from the parent across fork and exec,
    so every child would report the benchmark process's own peak. VmHWM belongs to this
    process image; writing 5 to clear_refs resets it to the current RSS before the call.
    """
    contenders = build_group(group, size)
    with torch.inference_mode():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # older kernels: the peak may then include the set-up, never less
        before = _status_bytes("VmRSS")
        contenders[name]()
        peak = _status_bytes("VmHWM")
    print(json.dumps({"peak_delta_bytes": max(peak - before, 0)}))


def measure_memory(group: str, size: Size, name: str, threads: int) -> int | None:
    cmd = [
        sys.executable, __file__, "--memory-child", group, name,
        "--child-size", json.dumps(size.__dict__), "--threads", str(threads),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"  memory of {name!r} not measured: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_delta_bytes"])


def run_group(group: str, size: Size, repeats: int, threads: int, memory: bool) -> list[dict]:
    print(f"[{group}] {size.label()} ...", file=sys.stderr, flush=True)
    times = time_group(build_group(group, size), repeats)
    matrix_bytes = size.batch * size.heads * size.tokens * size.tokens * 4
    rows = []
    for name, measured in times.items():
        # Ratio per round (the two calls ran seconds apart), then the median: steadier than
        # a ratio of medians when other jobs' load drifts during the run.
        ratio = harness.per_round_ratio(measured, times[REFERENCE])
        rows.append(
            {
                "group": group,
                "size": size.__dict__,
                "contender": name,
                "median_ms": measured.median_s * 1e3,
                "min_ms": min(measured.samples_s) * 1e3,
                "runs": len(measured.samples_s),
                "ratio_vs_raw_sdpa": ratio,
                "peak_rss_delta_mib": (
                    measure_memory(group, size, name, threads) / 2**20 if memory else None
                ),
                "score_matrix_mib": matrix_bytes / 2**20,
            }
        )
    return rows


def _fmt_mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| group | size | contender | median ms | min ms | ratio vs raw SDPA | peak RSS Δ MiB | T×S matrix MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        size = Size(**r["size"])
        lines.append(
            f"| {r['group']} | {size.label()} | {r['contender']} | {r['median_ms']:,.1f} | {r['min_ms']:,.1f} | "
            f"{r['ratio_vs_raw_sdpa']:.2f}x | {_fmt_mib(r['peak_rss_delta_mib'])} | "
            f"{r['score_matrix_mib']:,.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time qkv's attention kernels and layers against raw PyTorch "
        "(medians, ratios vs raw scaled_dot_product_attention from the same run, peak memory)."
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 3 repeats: a smoke run")
    harness.add_rounds(parser, None, "--repeats", help="alternating rounds: timed runs per contender (default 7, quick 3)")
    harness.add_threads(parser, torch.get_num_threads())
    parser.add_argument("--no-memory", action="store_true", help="skip the per-contender memory subprocesses")
    harness.add_json(parser, help="also write every row, the command and the machine to this JSON file")
    parser.add_argument("--memory-child", nargs=2, metavar=("GROUP", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--child-size", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args.memory_child[0], Size(**json.loads(args.child_size)), args.memory_child[1])
        return 0
    repeats = args.rounds or (3 if args.quick else 7)
    facts = harness.header("attention: qkv's kernels and layers against raw PyTorch")
    book = QUICK_BOOK if args.quick else FULL_BOOK
    sweep = QUICK_SWEEP if args.quick else FULL_SWEEP
    memory = not args.no_memory
    rows: list[dict] = []
    for group in ("kernels", "kernels_masked", "modules"):
        rows += run_group(group, book, repeats, args.threads, memory)
    for tokens in sweep:
        size = Size(batch=SWEEP_BATCH, tokens=tokens, emb_dim=book.emb_dim, heads=book.heads)
        rows += run_group("sweep", size, repeats, args.threads, memory)
    print(
        f"{facts['cpu']}, {torch.get_num_threads()} threads, torch {facts['torch']}; "
        f"forward, eval, no grad, fp32, causal; median of {repeats} runs"
    )
    print(markdown_table(rows))
    if args.json:
        harness.write_json(args.json, {"repeats": repeats, "rows": rows}, facts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
