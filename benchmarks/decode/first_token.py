"""Where `qkv generate`'s time to the first token goes, phase by phase, in fresh processes.

    .venv/bin/python benchmarks/decode/first_token.py [--runs 5] [--model smollm2] [--json PATH]

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
The first run also fills the caches (qkv's kernels, the prepared weights, Inductor's), so it
is reported apart; the others are "second runs" and their medians are printed. Timings of each run are printed as they come.
One contender, so nothing alternates; the machine's facts head the output (benchmarks/harness.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

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


def run_once(model: str, cache: str) -> dict[str, float]:
    import os
    import time

    argv = ["generate", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "1"]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, repr(time.time()), *argv], capture_output=True, text=True, check=True,
        # bytecode written and read as on a user's machine: an environment that turns it off
        # (PYTHONDONTWRITEBYTECODE, set in some sandboxes) compiles qkv's ~100 modules every run
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"QKV_CACHE_DIR": cache},
    )
    line = next(l for l in done.stderr.splitlines() if l.startswith("MARKS "))
    return json.loads(line.removeprefix("MARKS "))


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--runs", type=int, default=5, help="second runs to take the median of (0: only the first)")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    facts = harness.header(f"time to the first token of `qkv generate --model {args.model}`, fresh processes")
    from tokenizers import Tokenizer  # noqa: F401 - only to fail early without the venv

    import tempfile

    rows = []
    first: dict[str, float] = {}
    cache = tempfile.TemporaryDirectory(prefix="qkv-first-token-")
    for i in range(args.runs + 1):
        measured = run_once(args.model, cache.name)
        marks = {k: measured.get(k, 0.0) for k in PHASES}  # a phase the run did not go through took 0
        print(("first " if i == 0 else "second") + "  " + "  ".join(f"{k} {marks[k]:.2f}" for k in PHASES), flush=True)
        if i:
            rows.append(marks)
        else:
            first = marks
    medians = harness.median_of_each(rows) if rows else {}
    if rows:
        print("median  " + "  ".join(f"{k} {medians[k]:.2f}" for k in PHASES))
    cache.cleanup()
    if args.json:
        harness.write_json(args.json, {"model": args.model, "phases_s": {"first": first, "second_runs": rows,
                                                                         "second_median": medians}}, facts)


if __name__ == "__main__":
    main()
