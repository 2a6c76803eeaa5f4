"""startup: wall time of `qkv --help`, of each subcommand's `--help` (no torch import:
the target is under 0.5 s) and of `qkv explain` on the book's example (target: under 2 s),
each a fresh process, launch to exit, median of --repeats runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from qkv.bench.common import Context, Section
from qkv.names import SUBCOMMANDS
from qkv.errors import QkvError
from qkv.bench.measure.timing import Measurement


def qkv_command() -> list[str]:
    """The installed `qkv` script next to this interpreter, else `python -m qkv`."""
    script = Path(sys.executable).parent / "qkv"
    if script.is_file():
        return [str(script)]
    found = shutil.which("qkv")
    return [found] if found else [sys.executable, "-m", "qkv"]


def wall_times(argv: list[str], runs: int) -> tuple[float, ...]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, check=False)
        samples.append(time.perf_counter() - start)
        if done.returncode != 0:
            tail = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise QkvError(f"{' '.join(argv)} failed (exit {done.returncode}): {tail}")
    return tuple(samples)


def startup_section(ctx: Context) -> Section:
    section = Section("startup")
    qkv = qkv_command()
    commands = {"qkv --help": ["--help"]}
    commands.update({f"qkv {name} --help": [name, "--help"] for name in SUBCOMMANDS})
    commands["qkv explain"] = ["explain"]
    for label, args in commands.items():
        ctx.progress(label)
        section.measurements.append(Measurement(label, 1.0, "runs", wall_times([*qkv, *args], ctx.options.repeats)))
    helps = [m for m in section.measurements if m.name.endswith("--help")]
    slowest = max(helps, key=lambda m: m.median_s)
    section.facts["slowest --help (median s)"] = {slowest.name: round(slowest.median_s, 3)}
    section.facts["every --help under 0.5 s"] = all(m.median_s < 0.5 for m in helps)
    explain = section.measurements[-1]
    section.facts["qkv explain under 2 s"] = explain.median_s < 2.0
    section.facts["command"] = " ".join(qkv)
    return section
