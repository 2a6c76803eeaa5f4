"""`qkv bench`: qkv against its contenders on the same weights, side by side, in one
process family; sections from the registry in qkv.bench (what each measures: there).

Prints one Markdown table per section (medians, rates, ratios from the same run; progress
on stderr) and, with --json FILE, writes every sample, median and ratio as JSON,
atomically, after every section ("complete": true once all ran). Importing this module
imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

SECTION_HELP = ("decode, roofline, prefill, cache, kv_bytes, attention, plot (the default set), "
                "smollm2, quality, startup, kv-cache, kv-window")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        description="Measure qkv against transformers and llama.cpp (each when installed): "
        "decode tokens/s and the bandwidth roofline on a random GPT-2-124M-shaped checkpoint, "
        "prefill, cache vs no cache, KV-cache bytes, attention kernels, tokens/s against "
        "context length; with --only: SmolLM2 as `qkv generate` runs it by default against "
        "llama.cpp on the same GGUF (smollm2), perplexity of each precision (quality, needs "
        "--data) and start-up times (startup). Contenders alternate; medians of --repeats "
        "runs; ratios from the same run.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: a smoke test of every code path (numbers mean little)")
    parser.add_argument("--threads", type=int, default=2, metavar="N",
                        help="torch (and llama.cpp) threads (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, metavar="R",
                        help="timed runs per contender, at least 5 (default: %(default)s)")
    parser.add_argument("--only", action="append", metavar="SECTION",
                        help=f"run only these sections (repeatable, or comma-separated): {SECTION_HELP}")
    parser.add_argument("--data", metavar="FILE",
                        help="UTF-8 text the quality section scores (e.g. the-verdict.txt); "
                        "without it that section is skipped")
    parser.add_argument("--json", metavar="FILE", help="write every measurement to FILE as JSON")
    parser.add_argument("--plot", metavar="PNG",
                        help="write the tokens/s-against-context-length plot to this PNG file")
    parser.set_defaults(run=run)


def _check_output(path: str | None, what: str) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    if not out.parent.is_dir():
        raise QkvError(f"cannot write {what} {out}: folder {out.parent} does not exist; create it first")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def render(name: str, section: dict[str, Any]) -> str:
    """One section as Markdown: measurements, ratios, facts, what was skipped."""
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
    for line in section["skipped"]:
        lines.append(f"- {line}")
    return "\n".join(lines).rstrip() + "\n"


def run(args: argparse.Namespace) -> int:
    from qkv.bench import choose

    if args.threads < 1:
        raise QkvError(f"--threads must be at least 1, got {args.threads}")
    if args.repeats < 5:
        raise QkvError(f"--repeats must be at least 5 (medians of fewer runs are noise), got {args.repeats}")
    names = choose(args.only)
    json_path = _check_output(args.json, "JSON")
    plot_path = _check_output(args.plot, "plot")
    data = None
    if args.data is not None:
        from qkv.util.text_file import read_text_file

        read_text_file(args.data, when_empty="is empty; give --data a text to score")  # fail before measuring
        data = Path(args.data)

    import torch

    from qkv.util.atomic import atomic_write_text
    from qkv.bench.common import FULL, QUICK, Options, machine
    from qkv.bench.runner import run_sections

    torch.set_num_threads(args.threads)
    options = Options(sizes=QUICK if args.quick else FULL, repeats=args.repeats, threads=args.threads,
                      data=data, plot_path=plot_path,
                      progress=lambda message: print(f"... {message}", file=sys.stderr, flush=True))
    report: dict[str, Any] = {
        "schema": "qkv-bench/2",
        "command": "qkv bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else []),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick, "repeats": args.repeats, "threads": args.threads,
        "machine": machine(), "sections": {},
    }

    def write(complete: bool) -> None:
        if json_path is not None:
            atomic_write_text(json_path, json.dumps({**report, "complete": complete}, indent=2) + "\n")

    start = time.perf_counter()
    for section in run_sections(names, options):
        data_ = section.to_dict()
        report["sections"][section.name] = data_
        print(render(section.name, data_), flush=True)
        for line in section.skipped:
            print(line, file=sys.stderr, flush=True)
        write(False)  # after every section: a late failure keeps the rest
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["machine"]["load average at the end"] = [round(x, 2) for x in os.getloadavg()]
    write(True)
    if json_path is not None:
        print(f"wrote {json_path}", file=sys.stderr)
    return 0
