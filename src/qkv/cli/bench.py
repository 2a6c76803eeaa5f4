"""`qkv bench`: qkv against transformers on the same weights, side by side, in one process.

Prints one Markdown table per section (medians, rates, ratios from the same run) and,
with --json FILE, writes every sample, median and ratio as JSON (atomically). See
qkv.perf.bench for what each section measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qkv.atomic import atomic_write_text
from qkv.errors import QkvError

SECTION_HELP = "decode, roofline, prefill, cache, attention, kv_bytes, quality, plot"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        description="Measure qkv against transformers on the same random GPT-2-124M-shaped "
        "checkpoint: decode tokens/s (float32, bfloat16), the memory-bandwidth roofline, "
        "prefill, cache vs no cache, attention kernels, KV-cache bytes (MHA vs GQA), and "
        "tokens/s against context length. Contenders alternate; medians of --repeats runs; "
        "ratios from the same run.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: a smoke test of every code path in seconds (numbers mean little)")
    parser.add_argument("--threads", type=int, default=2, metavar="N",
                        help="torch threads (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, metavar="R",
                        help="timed runs per contender, at least 5 (default: %(default)s)")
    parser.add_argument("--only", action="append", metavar="SECTION",
                        help=f"run only this section (repeatable, or comma-separated): {SECTION_HELP}")
    parser.add_argument("--compile", action="store_true",
                        help="also time qkv with torch.compile (falls back to eager where it cannot compile)")
    parser.add_argument("--quantize", choices=["int8"],
                        help="also time qkv with weight-only int8 linears and measure their quality cost")
    parser.add_argument("--json", metavar="FILE", help="write every measurement to FILE as JSON")
    parser.add_argument("--plot", metavar="PNG",
                        help="write the tokens/s-against-context-length plot to this PNG file")
    parser.set_defaults(run=run)


def _sections(only: list[str] | None, quantize: str | None) -> list[str]:
    from qkv.perf.bench import SECTIONS

    if not only:
        return [name for name in SECTIONS if name != "quality" or quantize]
    names = [part.strip() for item in only for part in item.split(",") if part.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        raise QkvError(f"unknown section {', '.join(unknown)}; choose from {SECTION_HELP}")
    return [name for name in SECTIONS if name in names]  # in the canonical order


def _check_output(path: str | None, what: str) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    if not out.parent.is_dir():
        raise QkvError(f"cannot write {what} {out}: folder {out.parent} does not exist; create it first")
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def render(name: str, section: dict[str, Any]) -> str:
    """One section as Markdown: measurements, ratios, facts."""
    lines = [f"### {name}", ""]
    if section["measurements"]:
        lines += ["| contender | median s | rate |", "|---|---:|---:|"]
        for m in section["measurements"]:
            lines.append(f"| {m['name']} | {m['median_s']:.4f} | {m['rate']:.2f} {m['unit']}/s |")
        lines.append("")
    if section["ratios"]:
        lines += ["| ratio | value |", "|---|---:|"]
        for r in section["ratios"]:
            lines.append(f"| {r['of']} / {r['over']} | {r['value']:.3f}x |")
        lines.append("")
    for key, value in section["facts"].items():
        lines.append(f"- {key}: {_fmt(value)}")
    return "\n".join(lines).rstrip() + "\n"


def run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise QkvError(f"--threads must be at least 1, got {args.threads}")
    if args.repeats < 5:
        raise QkvError(f"--repeats must be at least 5 (medians of fewer runs are noise), got {args.repeats}")
    names = _sections(args.only, args.quantize)
    json_path = _check_output(args.json, "JSON")
    plot_path = _check_output(args.plot, "plot")
    from qkv.perf.bench import FULL, QUICK, Options, machine, run_sections

    torch.set_num_threads(args.threads)
    opts = Options(sizes=QUICK if args.quick else FULL, repeats=args.repeats, compile=args.compile,
                   quantize=args.quantize, plot_path=plot_path,
                   progress=lambda message: print(f"... {message}", file=sys.stderr, flush=True))
    report: dict[str, Any] = {
        "schema": "qkv-bench/1",
        "command": "qkv bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else []),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick, "repeats": args.repeats, "threads": args.threads,
        "machine": machine(), "sections": {},
    }
    start = time.perf_counter()
    for section in run_sections(names, opts):
        data = section.to_dict()
        report["sections"][section.name] = data
        print(render(section.name, data), flush=True)
        if json_path is not None:  # after every section: a late failure keeps the rest
            _write_json(json_path, {**report, "complete": False})
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["machine"]["load average at the end"] = [round(x, 2) for x in os.getloadavg()]
    report["complete"] = True
    if json_path is not None:
        _write_json(json_path, report)
        print(f"wrote {json_path}", file=sys.stderr)
    return 0
