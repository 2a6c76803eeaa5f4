"""`qkv explain` (the book's six-token example) launch to exit, against an older qkv source
tree and against `import torch` alone (the floor: the walkthrough computes with torch).

    python benchmarks/explain_startup.py --base /tmp/qkv-base/src --repeats 7

Each contender is a fresh process with its own PYTHONPATH; the runs alternate (base, new,
torch, base, new, ...) so a busy machine slows them alike. Prints the medians, the ratio, and
whether the two trees print the same text.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "src"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str], src: Path | None) -> tuple[float, float, bytes]:
    """Wall seconds, CPU seconds (user + system: less swayed by other work on the machine)
    and the output of one fresh process."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cpu, start = _cpu(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, env=env, check=True)
    return time.perf_counter() - start, _cpu() - cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the src/ folder of the qkv to compare with")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    explain = [sys.executable, "-m", "qkv", "explain"]
    contenders = {"base": (explain, args.base), "new": (explain, HERE),
                  "import torch": ([sys.executable, "-c", "import torch"], None)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpus: dict[str, list[float]] = {name: [] for name in contenders}
    outputs: dict[str, bytes] = {}
    for _ in range(args.repeats):
        for name, (argv, src) in contenders.items():
            seconds, cpu, out = _run(argv, src)
            times[name].append(seconds)
            cpus[name].append(cpu)
            outputs[name] = out
    for name, samples in times.items():
        print(f"{name:>13}: wall median {statistics.median(samples):.3f} s (min {min(samples):.3f}, "
              f"max {max(samples):.3f}), CPU median {statistics.median(cpus[name]):.3f} s, {len(samples)} runs")
    for label, table in (("wall", times), ("CPU", cpus)):
        base, new, floor = (statistics.median(table[n]) for n in ("base", "new", "import torch"))
        print(f"{label}: new / base {new / base:.2f}; new - import torch {new - floor:+.3f} s")
    print(f"same output: {outputs['base'] == outputs['new']}")


if __name__ == "__main__":
    main()
