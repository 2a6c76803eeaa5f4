"""`qkv explain` (the book's six-token example) launch to exit, against an older qkv source
tree and against `import torch` alone (the floor: the walkthrough computes with torch).

    python benchmarks/decode/explain_startup.py --base /tmp/qkv-base/src --rounds 7   # (--repeats: the same)

Each contender is a fresh process with its own PYTHONPATH; the runs alternate (base, new,
torch, then new, torch, base, ...: who goes first rotates; benchmarks/harness.py's
`alternate_own` on qkv.bench.measure.timing's rounds, each run reporting its wall and CPU
seconds) so a busy machine slows them alike. Prints the medians, the ratio, and whether the
two trees print the same text.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

HERE = harness.SRC  # this tree's sources


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
    parser = harness.parser(__doc__, rounds=7, rounds_aliases=("--repeats",), json=True)
    parser.add_argument("--base", type=Path, required=True, help="the src/ folder of the qkv to compare with")
    args = parser.parse_args()
    facts = harness.header("`qkv explain` launch to exit: an older tree, this one, `import torch`")
    explain = [sys.executable, "-m", "qkv", "explain"]
    contenders = {"base": (explain, args.base), "new": (explain, HERE),
                  "import torch": ([sys.executable, "-c", "import torch"], None)}
    outputs: dict[str, bytes] = {}

    def contender(name: str):
        def call() -> dict[str, float]:
            seconds, cpu, outputs[name] = _run(*contenders[name])
            return {"wall_s": seconds, "cpu_s": cpu}
        return call

    own = harness.alternate_own({name: contender(name) for name in contenders}, rounds=args.rounds)
    times = {name: harness.Measurement(name, 1, "runs", s["wall_s"]) for name, s in own.items()}
    cpus = {name: harness.Measurement(f"{name} CPU", 1, "runs", s["cpu_s"]) for name, s in own.items()}
    for name, m in times.items():
        print(f"{name:>13}: wall median {m.median_s:.3f} s (min {min(m.samples_s):.3f}, "
              f"max {max(m.samples_s):.3f}), CPU median {cpus[name].median_s:.3f} s, {len(m.samples_s)} runs")
    for label, table in (("wall", times), ("CPU", cpus)):
        base, new, floor = (table[n] for n in ("base", "new", "import torch"))
        # new / base as seconds over seconds: the inverse of harness.ratio's rate over rate
        print(f"{label}: new / base {1 / harness.ratio(new, base).value:.2f}; "
              f"new - import torch {new.median_s - floor.median_s:+.3f} s")
    print(f"same output: {outputs['base'] == outputs['new']}")
    if args.json:
        harness.write_json(args.json, {"base": str(args.base), "same_output": outputs["base"] == outputs["new"],
                                       "wall": harness.summary(times.values()), "cpu": harness.summary(cpus.values())},
                           facts)


if __name__ == "__main__":
    main()
