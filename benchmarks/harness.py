"""The one harness of benchmarks/: contenders alternating round by round, medians, ratios
measured in the same run, the machine's facts, and the few pieces every script repeats.

Timing is the package's own, qkv.bench.measure.timing (re-exported here): `alternate` calls
every contender once per round, who goes first rotating, after `warmup` untimed calls each,
and returns a `Measurement` per contender (its samples, median, rate = work / median);
`ratio(a, b)` is rate(a) / rate(b) from those medians, so it is always a ratio of the same
run. `alternate_probed` adds a probe before and after every call (the roofline's bandwidth).
What this module adds is only what the scripts need beside that:

- `alternate_own`: the same rounds for contenders that measure themselves (llama-bench
  reports its own tokens/s; a decode step timed without its prefill; CPU seconds; a server
  run's tokens/s and time to first token): each call returns its numbers, and the rotation,
  warm-up and order are `alternate`'s, because `alternate` runs them;
- `self_timed`: such seconds as `Measurement`s, so that medians and ratios come from the
  package as for everything else; `median_ratio` for numbers that are not seconds of a
  fixed amount of work (a server run's tokens/s);
- `machine()` / `header()`: the CPU (model, family, cores, the AVX2 / AVX-512 / VNNI / AMX
  flags present), torch and its thread count, Python, the load average and the commit,
  printed as a header and returned as a dict for the JSON output;
- `parser()`, `add_rounds()`, `add_json()`, `add_threads()`: the shared flags; `write_json()`
  writes a result atomically (qkv.util.atomic) with the command and the machine in it;
- `table()`: medians, rates, each round and the ratios as one Markdown table;
- `free_port()`, `running()`: a server subprocess on 127.0.0.1, up when it answers its
  health URL, always stopped.

Every script under benchmarks/<group>/ runs from the repository root as
`.venv/bin/python benchmarks/<group>/<name>.py` and finds this module with

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
    import harness

llama.cpp's tools (llama-bench, llama-server, llama-perplexity ...) are found by llama_tools.py,
next to this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from qkv.bench.measure.timing import Measurement, Probed, Ratio, alternate, alternate_probed, ratio
from qkv.util.atomic import atomic_write_text

__all__ = [
    "BENCHMARKS", "Measurement", "Probed", "ROOT", "Ratio", "SHARED_DATA", "SRC", "VERDICT", "add_json",
    "add_rounds", "add_threads", "alternate", "alternate_own", "alternate_probed", "free_port",
    "header", "machine", "median", "median_of_each", "median_ratio", "parser", "per_round_ratio", "ratio", "ratios_over",
    "running", "self_timed", "summary", "table", "write_json",
]

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent  # the repository
SRC = ROOT / "src"
SHARED_DATA = ROOT.parent / "shared" / "data"  # the workspace's data folder, beside the repository
VERDICT = SHARED_DATA / "the-verdict.txt"  # the book's short story

# CPU flags that decide which kernels run (qkv's variants, llama.cpp's builds).
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx512vbmi", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sha_ni")


# ----------------------------------------------------------------------------- timing


def median(values: Iterable[float]) -> float:
    """statistics.median, for numbers that are not seconds of one contender (a phase, a percentile)."""
    return statistics.median(list(values))


def median_of_each(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The median of every key over rows of numbers (runs of one contender), keys of the first row."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def alternate_own(contenders: Mapping[str, Callable[[], Mapping[str, float]]], *, rounds: int,
                  warmup: int = 0) -> dict[str, dict[str, tuple[float, ...]]]:
    """`alternate`'s rounds for contenders that measure themselves.

    Each call returns its own numbers by name ({"seconds": ..., "cpu_s": ...}); `alternate`
    runs the calls (the order rotating each round, `warmup` untimed calls of each first), and
    this returns, per contender, each number's samples in round order, the warm-up calls left
    out. `alternate`'s own wall-clock samples are not used.
    """
    recorded: dict[str, list[Mapping[str, float]]] = {name: [] for name in contenders}

    def recording(name: str) -> Callable[[], None]:
        return lambda: recorded[name].append(contenders[name]())

    alternate({name: recording(name) for name in contenders}, work=1, unit="calls", repeats=rounds, warmup=warmup)
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for name, calls in recorded.items():
        timed = calls[warmup:]
        out[name] = {key: tuple(float(call[key]) for call in timed) for key in (timed[0] if timed else {})}
    return out


def self_timed(contenders: Mapping[str, Callable[[], float]], *, work: float | Mapping[str, float], unit: str,
               rounds: int, warmup: int = 0) -> dict[str, Measurement]:
    """`alternate_own` for contenders that return the seconds their `work` took (a decode
    timed after its prefill, a tool's own timing turned into seconds)."""
    samples = alternate_own({name: (lambda fn=fn: {"seconds": fn()}) for name, fn in contenders.items()},
                            rounds=rounds, warmup=warmup)
    per = work if isinstance(work, Mapping) else {name: work for name in contenders}
    return {name: Measurement(name, float(per[name]), unit, s["seconds"]) for name, s in samples.items()}


def median_ratio(of: str, of_values: Iterable[float], over: str, over_values: Iterable[float]) -> Ratio:
    """For numbers each run measures itself (a server run's tokens/s or time to first token):
    the ratio of their medians, of over over, both from the same run of rounds. Unlike
    `ratio`, nothing is inverted: two rates give rate over rate, two times time over time."""
    return Ratio(of, over, statistics.median(list(of_values)) / statistics.median(list(over_values)))


def ratios_over(measurements: Mapping[str, Measurement], over: str) -> list[Ratio]:
    """ratio(m, measurements[over]) for every other contender: rate over rate, > 1 is faster."""
    return [ratio(m, measurements[over]) for name, m in measurements.items() if name != over]


def per_round_ratio(of: Measurement, over: Measurement) -> float:
    """The median over rounds of of's seconds / over's seconds in the same round (> 1 is
    slower). `alternate` keeps each contender's samples in round order, so sample i of
    both ran in round i, seconds apart: steadier than a ratio of medians when the load
    drifts during a run (benchmarks/kernels/attention.py reports this one)."""
    return statistics.median(a / b for a, b in zip(of.samples_s, over.samples_s, strict=True))


# ----------------------------------------------------------------------------- the machine


def _cpuinfo() -> dict[str, Any]:
    facts: dict[str, Any] = {}
    cores: set[tuple[str, str]] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    block: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if line.strip():
            key, _, value = line.partition(":")
            block[key.strip()] = value.strip()
            continue
        if block:
            facts.setdefault("cpu", block.get("model name"))
            facts.setdefault("cpu family", block.get("cpu family"))
            facts.setdefault("cpu model", block.get("model"))
            facts.setdefault("cache size", block.get("cache size"))
            facts.setdefault("flags", set(block.get("flags", "").split()))
            cores.add((block.get("physical id", "0"), block.get("core id", block.get("processor", "0"))))
            block = {}
    if not facts.get("cpu") or not facts.get("flags"):  # not Linux's /proc: lscpu, where there is one
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            for line in lscpu.splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model name":
                    facts["cpu"] = value.strip()
                elif key.strip() == "Flags":
                    facts["flags"] = set(value.split())
    facts["cores"] = len(cores) or None
    return facts


def _commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if done.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    return None


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(*, packages: Iterable[str] = ()) -> dict[str, Any]:
    """The machine a run measured: CPU model, family and model numbers, logical CPUs and
    cores, memory, the kernel-relevant flags present, torch and its threads, Python, the load
    average, the commit; `packages`' versions (read from their metadata: nothing is imported)."""
    cpu = _cpuinfo()
    flags = cpu.pop("flags", set()) or set()
    facts: dict[str, Any] = {
        "cpu": cpu.get("cpu") or platform.processor() or platform.machine(),
        "cpu family": cpu.get("cpu family"), "cpu model": cpu.get("cpu model"),
        "logical cpus": os.cpu_count(), "cores": cpu.get("cores"), "memory GiB": _memory_gib(),
        "flags": [flag for flag in FLAGS if flag in flags],
        "python": platform.python_version(),
    }
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        facts["torch"], facts["torch threads"] = torch.__version__, torch.get_num_threads()
    else:
        facts["torch"], facts["torch threads"] = _version("torch"), None
    for package in packages:
        facts[package] = _version(package)
    facts["load average (1, 5, 15 min)"] = [round(x, 2) for x in os.getloadavg()]
    facts["commit"] = _commit()
    return facts


def header(title: str | None = None, *, packages: Iterable[str] = ()) -> dict[str, Any]:
    """Print the machine's facts (and `title`) as '# ' lines; return them for the JSON."""
    facts = machine(packages=packages)
    if title:
        print(f"# {title}")
    family = f" (family {facts['cpu family']} model {facts['cpu model']})" if facts["cpu family"] else ""
    cores = f" / {facts['cores']} cores" if facts["cores"] else ""
    memory = f", {facts['memory GiB']} GiB" if facts["memory GiB"] else ""
    print(f"# machine: {facts['cpu']}{family}, {facts['logical cpus']} logical CPUs{cores}{memory}; "
          f"flags: {' '.join(facts['flags']) or 'none of ' + ', '.join(FLAGS[:4])}")
    threads = f", {facts['torch threads']} threads" if facts["torch threads"] is not None else ""
    extra = "".join(f", {p} {facts[p]}" for p in packages)
    print(f"# torch {facts['torch']}{threads}; python {facts['python']}{extra}; commit {facts['commit']}; "
          f"load average {' '.join(f'{x:.2f}' for x in facts['load average (1, 5, 15 min)'])}", flush=True)
    return facts


# ----------------------------------------------------------------------------- flags and output


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser(doc: str | None, *, rounds: int | None = None, rounds_aliases: Sequence[str] = (),
           threads: int | None = None, json: bool = False) -> argparse.ArgumentParser:
    """An ArgumentParser whose description is the script's first docstring paragraph and
    whose epilog is the rest (the commands that reproduce it), shown as written; `rounds`,
    `threads` and `json` add the shared flags with those defaults (add_rounds, add_threads,
    add_json)."""
    first, _, rest = (doc or "").strip().partition("\n\n")
    made = argparse.ArgumentParser(description=first, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    if rounds is not None:
        add_rounds(made, rounds, *rounds_aliases)
    if threads is not None:
        add_threads(made, threads)
    if json:
        add_json(made)
    return made


def add_rounds(made: argparse.ArgumentParser, default: int, *aliases: str, help: str | None = None) -> None:
    """--rounds N (and older names of the same flag, e.g. --repeats): alternating rounds, each
    contender once per round; medians over them."""
    made.add_argument("--rounds", *aliases, dest="rounds", type=_at_least_one, default=default, metavar="N",
                      help=help or "alternating rounds: every contender once per round, medians over them "
                      "(default: %(default)s)")


def add_threads(made: argparse.ArgumentParser, default: int | None) -> None:
    made.add_argument("--threads", type=_at_least_one, default=default, metavar="N",
                      help="torch threads (default: %(default)s)")


def add_json(made: argparse.ArgumentParser, *, required: bool = False, help: str | None = None) -> None:
    made.add_argument("--json", type=Path, metavar="PATH", required=required,
                      help=help or "also write the results, the command and the machine here (atomically)")


def summary(measurements: Iterable[Measurement], ratios: Iterable[Ratio] = ()) -> dict[str, Any]:
    """Measurements (every sample, median, rate) and ratios as JSON-ready data."""
    return {"measurements": [m.to_dict() for m in measurements], "ratios": [r.to_dict() for r in ratios]}


def write_json(path: str | Path, payload: Mapping[str, Any], facts: Mapping[str, Any] | None = None) -> None:
    """Write `payload` as JSON at `path` atomically (qkv.util.atomic.atomic_write_text: a reader
    sees the old file or the new one), with the command, the time and the machine added
    (`facts`, from header(), with the load average at the end)."""
    out = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
    if facts is not None:
        out["machine"] = {**facts, "load average at the end": [round(x, 2) for x in os.getloadavg()]}
    atomic_write_text(path, json.dumps(out, indent=1, default=str) + "\n")


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def table(measurements: Iterable[Measurement], ratios: Iterable[Ratio] = (), *, rounds: str = "rate",
          per_work: bool = False) -> str:
    """Medians as a Markdown table: the median time (per unit of work with `per_work`), the
    fastest sample, the rate at the median, and each round (`rounds`: "rate", "time" or "");
    then the ratios, rate over rate (> 1: the first is faster)."""
    lines = ["| contender | median | min | rate | rounds |", "|---|---:|---:|---:|---|"]
    for m in measurements:
        scale = 1 / m.work if per_work else 1.0
        cells = ""
        if rounds == "rate":
            cells = ", ".join(f"{m.work / s:.4g}" for s in m.samples_s) + f" {m.unit}/s"
        elif rounds == "time":
            cells = ", ".join(_seconds(s * scale) for s in m.samples_s)
        per = f" a {m.unit.rstrip('s')}" if per_work else ""
        lines.append(f"| {m.name} | {_seconds(m.median_s * scale)}{per} | {_seconds(min(m.samples_s) * scale)} "
                     f"| {m.rate:.4g} {m.unit}/s | {cells} |")
    ratios = list(ratios)
    if ratios:
        lines += ["", "| ratio (rate over rate, same run) | value |", "|---|---:|"]
        lines += [f"| {r.of} / {r.over} | {r.value:.3f}x |" for r in ratios]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- servers


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(command: Sequence[str], health: str, *, timeout: float = 300, env: Mapping[str, str] | None = None,
            stdout: Any = subprocess.DEVNULL, stderr: Any = None, stop: int = signal.SIGTERM,
            stop_timeout: float = 30) -> Iterator[subprocess.Popen]:
    """`command` as a subprocess, yielded once `health` (a URL) answers 200; stopped on exit
    (`stop`, then killed after `stop_timeout` s), also when the caller stopped it already.
    Exits with a one-line message when it dies or does not come up within `timeout` s."""
    process = subprocess.Popen(list(command), stdout=stdout, stderr=stderr, env=None if env is None else dict(env))
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(health, timeout=2) as reply:
                    if reply.status == 200:
                        break
            if process.poll() is not None:
                said = process.stderr.read().decode(errors="replace")[-2000:] if stderr == subprocess.PIPE else ""
                raise SystemExit(f"{Path(command[0]).name} {' '.join(command[1:3])} exited ({process.returncode}) "
                                 f"before answering {health}{': ' + said if said else ''}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{Path(command[0]).name} did not answer {health} within {timeout:.0f} s")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(stop)
            try:
                process.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
