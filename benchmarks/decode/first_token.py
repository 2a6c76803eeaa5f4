"""Where `qkv generate`'s time to the first token goes, phase by phase, in fresh processes.

    .venv/bin/python benchmarks/decode/first_token.py [--runs 5] [--model smollm2] [--json PATH]
        [--llama-server [PATH]] [--llama-threads 2]

Each run starts a new Python process that runs the real command,
`qkv generate --model M --prompt <32 tokens> --max-new-tokens 1` (default flags: auto
precision, compiled), with the functions it goes through wrapped in timers, in a fresh
cache folder ($QKV_CACHE_DIR, so the first run builds qkv's kernels and keeps the prepared
weights as a first-ever run does). Phases, in order:

- import: from the process start (interpreter included) to `qkv.cli.generate` and what
  its `run` imports (torch, the loader, generation) imported; the command's reading of the
  busy cores (qkv.util.threads) is taken before that, as `qkv generate` takes it, so its
  watch window is already over when the threads are set;
- header: the file's header, config, tensor shapes and tokenizer (`qkv.models.loader.open_model`);
- cached: reading the prepared weights kept by an earlier run (`read_prepared`,
  qkv.runtime.prepared_cache; 0 on a run that takes the file's blocks as stored);
- weights: the model built with its weights: the file's 4-bit or other blocks as stored
  (`load_stored_four_bits`, `load_stored_blocks`) or every tensor read (`OpenedModel.build`);
- build: the model made empty for kept weights (`OpenedModel.skeleton`);
- prepare: fuse and quantize, or make the same layers empty for the kept weights (`_shape_layers`);
- keep: writing the prepared weights for the next run (`keep_prepared`, the first run only);
- finish: weights onto 2 MB pages, the fused layers or Inductor's regions (`_finish`);
- compile: the part of finish in `compile_decoder` (probing the compiler, marking regions);
- warm-up: the compiled decode step run once (`warm_up`; a cache lookup on a second run);
- prefill: from the request to the first token (the 32-token prompt, one step);
- total: from the process start to the first token.

Each run writes and reads Python's bytecode as a user's install does, whatever
PYTHONDONTWRITEBYTECODE says here (with it set, every run compiled qkv's modules again: 0.1 s).
qkv's kernels are built into the fresh cache folder first (once per machine, as after an
install; the time is printed), so the first run is a first run of this file: it fills the
caches of the file (the prepared weights, the checked blocks, the merges, Inductor's) and is
reported apart; the others are "second runs" and their medians are printed. Timings of each
run are printed as they come; the machine's facts head the output (benchmarks/harness.py).

With --llama-server PATH, llama.cpp's server is the peer, alternated with qkv run by run:
`llama-server -m FILE -t 2 -np 1 -c 512` on a free loopback port, polled every 20 ms until
/health answers 200 ("ready": its load, warm-up included), then one /completion of the same
prompt for one token ("total": process start to that answer). The ratio printed is qkv's total
over llama-server's, first runs and medians of the later ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import llama_tools  # noqa: E402

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press into one machine"
)

CHILD = r"""
import json, sys, time
T0 = float(sys.argv[1])
marks = {}
from qkv.util.heap import hold_collections
hold_collections()  # as the command does before it imports torch (qkv.util.heap)
from qkv.util.threads import CpuClock
STARTED = CpuClock.now()  # the command reads this clock before it imports torch: no extra watch after
import qkv.cli.generate
qkv.cli.generate.CpuClock = type("Started", (), {"now": staticmethod(lambda: STARTED)})
# what generate's run() imports first thing (torch and the modules it loads with)
import torch, qkv.generation, qkv.models.loader, qkv.runtime.prepare, qkv.cli.perplexity
marks["import"] = time.time() - T0
from qkv.models import loader
from qkv.runtime import prepare
import qkv.generation as generation

def timed(owner, name, key):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            marks[key] = marks.get(key, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)

timed(loader, "open_model", "header")
timed(prepare, "load_stored_four_bits", "weights")
timed(prepare, "load_stored_blocks", "weights")
timed(loader.OpenedModel, "build", "weights")
timed(loader.OpenedModel, "skeleton", "build")
timed(prepare, "read_prepared", "cached")
timed(prepare, "_shape_layers", "prepare")
timed(prepare, "keep_prepared", "keep")
timed(prepare, "_finish", "finish")
timed(prepare, "compile_decoder", "compile")
timed(generation, "warm_up", "warm-up")
original_stream = generation.stream
def stream(*args, **kwargs):
    start = time.perf_counter()
    tokens = original_stream(*args, **kwargs)
    def first():
        for i, token in enumerate(tokens):
            if i == 0:
                marks["prefill"] = time.perf_counter() - start
                marks["total"] = time.time() - T0
            yield token
    return first()
generation.stream = stream
from qkv.cli.main import main
code = main(sys.argv[2:])
print("MARKS " + json.dumps(marks), file=sys.stderr)
sys.exit(code)
"""

PHASES = ("import", "header", "cached", "weights", "build", "prepare", "keep", "finish", "compile", "warm-up",
          "prefill", "total")


def child_env(cache: str) -> dict[str, str]:
    # bytecode written and read as on a user's machine: an environment that turns it off
    # (PYTHONDONTWRITEBYTECODE, set in some sandboxes) compiles qkv's ~100 modules every run
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"QKV_CACHE_DIR": cache}


def build_kernels(cache: str) -> float:
    """qkv's kernels built into `cache` (once per machine); the seconds it took."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from qkv.runtime.native.build import native_kernels; native_kernels()"],
                   check=True, env=child_env(cache), timeout=900)
    return time.perf_counter() - start


def run_once(model: str, cache: str) -> dict[str, float]:
    argv = ["generate", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "1"]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, repr(time.time()), *argv], capture_output=True, text=True, check=True,
        env=child_env(cache),
    )
    line = next(l for l in done.stderr.splitlines() if l.startswith("MARKS "))
    return json.loads(line.removeprefix("MARKS "))


def llama_server_once(binary: Path, model: str, threads: int) -> dict[str, float]:
    """llama-server from its start to one token of PROMPT: {"ready": s, "total": s}."""
    port = harness.free_port()
    command = [str(binary), "-m", model, "-t", str(threads), "-np", "1", "-c", "512",
               "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = start + 300
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            if process.poll() is not None:
                raise SystemExit(f"llama-server exited ({process.returncode}) before it answered {base}/health")
            if time.perf_counter() > deadline:
                raise SystemExit(f"llama-server did not answer {base}/health within 300 s")
            time.sleep(0.02)
        ready = time.perf_counter() - start
        request = urllib.request.Request(base + "/completion", data=json.dumps(
            {"prompt": PROMPT, "n_predict": 1, "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.read()
        return {"ready": ready, "total": time.perf_counter() - start}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--runs", type=int, default=5, help="second runs to take the median of (0: only the first)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--llama-server", nargs="?", const="", default=None, metavar="PATH",
                        help="alternate each run with llama.cpp's llama-server from start to one token "
                        "(no PATH: the one benchmarks/README.md builds)")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t (default 2)")
    args = parser.parse_args()
    facts = harness.header(f"time to the first token of `qkv generate --model {args.model}`, fresh processes")
    from tokenizers import Tokenizer  # noqa: F401 - only to fail early without the venv

    import tempfile

    server = None if args.llama_server is None else llama_tools.tool("llama-server", args.llama_server or None)
    if server is not None and not Path(args.model).is_file():
        raise SystemExit("--llama-server needs --model FILE.gguf (llama-server reads GGUF files)")
    rows, peer_rows = [], []
    first: dict[str, float] = {}
    peer_first: dict[str, float] = {}
    cache = tempfile.TemporaryDirectory(prefix="qkv-first-token-")
    print(f"qkv's kernels built in {build_kernels(cache.name):.1f} s (once per machine)", flush=True)
    for i in range(args.runs + 1):
        contenders = ["qkv", "llama-server"] if server is not None else ["qkv"]
        for name in contenders if i % 2 == 0 else contenders[::-1]:  # who goes first alternates
            label = "first " if i == 0 else "second"
            if name == "qkv":
                measured = run_once(args.model, cache.name)
                marks = {k: measured.get(k, 0.0) for k in PHASES}  # a phase the run did not go through took 0
                print(f"{label}  " + "  ".join(f"{k} {marks[k]:.2f}" for k in PHASES), flush=True)
                rows.append(marks) if i else first.update(marks)
            else:
                peer = llama_server_once(server, args.model, args.llama_threads)
                print(f"{label}  llama-server  ready {peer['ready']:.2f}  total {peer['total']:.2f}", flush=True)
                peer_rows.append(peer) if i else peer_first.update(peer)
    medians = harness.median_of_each(rows) if rows else {}
    peer_medians = harness.median_of_each(peer_rows) if peer_rows else {}
    if rows:
        print("median  " + "  ".join(f"{k} {medians[k]:.2f}" for k in PHASES))
    if server is not None:
        print(f"first run: qkv {first['total']:.2f} s, llama-server {peer_first['total']:.2f} s "
              f"(ready {peer_first['ready']:.2f}): {first['total'] / peer_first['total']:.2f}x")
        if rows:
            print(f"later runs (medians): qkv {medians['total']:.2f} s, llama-server {peer_medians['total']:.2f} s "
                  f"(ready {peer_medians['ready']:.2f}): {medians['total'] / peer_medians['total']:.2f}x")
    cache.cleanup()
    if args.json:
        harness.write_json(args.json, {"model": args.model, "phases_s": {"first": first, "second_runs": rows,
                                                                         "second_median": medians},
                                       "llama_server_s": {"first": peer_first, "second_runs": peer_rows,
                                                          "second_median": peer_medians}}, facts)


if __name__ == "__main__":
    main()
