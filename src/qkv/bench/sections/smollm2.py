"""smollm2: SmolLM2-135M-Instruct decoded by qkv exactly as `qkv generate` runs it by
default (`load_for_generation("smollm2")`: the default precision, compiled, warmed up with
`qkv.generation.warm_up`), against llama.cpp (llama-cpp-python) on the same GGUF file and
transformers float32 on the same weights: a prompt of 32 tokens, 128 greedy new tokens
(end tokens do not stop anyone), batch 1, --threads threads. Each timed call is one
generation, prompt included; loading and compiling are not timed. Contenders alternate
round by round; medians; ratios from the same run. A contender that is not installed is
skipped with a one-line message.

Also: the compile (warm-up) time in this process; the time to the first token of a fresh
`qkv generate`-like process, first with empty caches (the first-ever run: qkv's kernels
built, the prepared weights kept, Inductor's caches filled where it compiles), then again
with the caches that run left (the warm start users get); and whether qkv's float32 greedy
tokens equal transformers'.

Shape legend: B batch (1), T prompt tokens, N new tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qkv.bench.common import Context, Section, optional
from qkv.bench.gpt2_checkpoint import hf_generate
from qkv.generation import generate, warm_up
from qkv.models.loader import smollm2_path
from qkv.runtime.prepare import load_for_generation
from qkv.bench.measure.timing import alternate, ratio
from qkv.names import DEFAULT_PRECISION

# Any English will do: the prompt is its first T tokens.
PROMPT_TEXT = (
    "The key to attention is a question each token asks of every other: how much do you matter "
    "to me? The answers are weights, and the weighted sum of values is what the token carries on. "
    "Write a short story about a robot who learns to paint, and tell it slowly."
)
QKV = f"qkv (qkv generate defaults: {DEFAULT_PRECISION} precision, compiled)"
LLAMA = "llama.cpp (same GGUF)"
TRANSFORMERS = "transformers float32"

# Run in a fresh interpreter: what `qkv generate` does before its first token.
FIRST_TOKEN_SCRIPT = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from qkv.generation import generate, warm_up
from qkv.runtime.prepare import load_for_generation
loaded = time.time()
model, tokenizer, setup = load_for_generation("smollm2")
loaded = time.time() - loaded
compile_s = warm_up(model, setup=setup)
generate(model, torch.tensor([json.loads(sys.argv[2])]), 1, setup=setup)
print(json.dumps({"first_token_at": time.time(), "load_s": loaded, "compile_s": compile_s,
                  "setup": setup.describe() + (", prepared weights from the cache" if setup.from_cache else "")}))
"""


def prompt_ids(tokenizer: Any, tokens: int) -> list[int]:
    ids: list[int] = tokenizer.encode(PROMPT_TEXT).ids
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def first_token(ids: list[int], threads: int, cache_dir: Path) -> dict[str, Any]:
    """A fresh process loads SmolLM2 as `qkv generate` does and makes one token; seconds
    from launching it to that token, with Inductor's caches and qkv's built kernels in
    `cache_dir` (so an empty one times everything a first run on a new machine does)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "QKV_CACHE_DIR": str(cache_dir / "qkv"),
           "OMP_NUM_THREADS": str(threads)}
    start = time.time()
    done = subprocess.run([sys.executable, "-c", FIRST_TOKEN_SCRIPT, str(threads), json.dumps(ids)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the process failed (exit {done.returncode}): {tail}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"time to first token s": round(result["first_token_at"] - start, 3),
            "load s": round(result["load_s"], 3), "compile (warm_up) s": round(result["compile_s"], 3),
            "setup": result["setup"]}


# Loads llama.cpp in a throw-away process first: a build for CPU features this machine
# lacks (AVX-512 on a CPU without it) dies with SIGILL, which would take the bench with it.
LLAMA_PROBE = """
import sys
from llama_cpp import Llama
Llama(model_path=sys.argv[1], n_threads=1, n_ctx=64, verbose=False)
"""


def llama_crash(path: Path) -> str | None:
    """None if llama.cpp loads `path` in a fresh process, else why not (one line)."""
    done = subprocess.run([sys.executable, "-c", LLAMA_PROBE, str(path)], capture_output=True, text=True,
                          check=False)
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        hint = " (an instruction this CPU lacks: rebuild it without AVX-512, see docs/bench.md)" if name == "SIGILL" else ""
        return f"loading the model killed the process with {name}{hint}"
    return f"loading the model failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"


def llama_contender(ids: list[int], new: int, threads: int) -> Callable[[], list[int]] | str:
    module = optional("llama_cpp", "llama.cpp")
    if isinstance(module, str):
        return module + "; build it as docs/bench.md says"
    crash = llama_crash(smollm2_path())
    if crash is not None:
        return f"llama.cpp: skipped ({crash})"
    llm = module.Llama(model_path=str(smollm2_path()), n_threads=threads, n_threads_batch=threads,
                       n_ctx=512, verbose=False)

    def run() -> list[int]:
        llm.reset()  # no prefix reuse from the previous call: every call evaluates the prompt
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == new:
                break
        return out

    return run


def transformers_contender(ids: torch.Tensor, new: int) -> tuple[Callable[[], list[int]], Any] | str:
    module = optional("transformers", "transformers")
    if isinstance(module, str):
        return module + "; pip install 'qkv[dev]'"
    path = smollm2_path()
    model = module.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    def run() -> list[int]:
        return hf_generate(model, ids, new, pad_token_id=0)[0, ids.shape[1]:].tolist()  # type: ignore[no-any-return]

    return run, model


def smollm2_section(ctx: Context) -> Section:
    s, threads = ctx.sizes, ctx.options.threads
    section = Section("smollm2")
    ctx.progress("loading SmolLM2 as qkv generate does")
    model, tokenizer, setup = load_for_generation("smollm2")
    section.facts["qkv setup"] = setup.describe()
    section.facts["compile (warm_up) s, this process"] = round(warm_up(model, setup=setup), 3)
    ids_list = prompt_ids(tokenizer, s.smollm2_prompt)
    ids = torch.tensor([ids_list])  # (B, T)
    new = s.smollm2_new
    contenders: dict[str, Callable[[], object]] = {QKV: lambda: generate(model, ids, new, setup=setup)}
    ctx.progress("loading llama.cpp")
    llama = llama_contender(ids_list, new, threads)
    if isinstance(llama, str):
        section.skipped.append(llama)
    else:
        contenders[LLAMA] = llama
    ctx.progress("loading transformers")
    hf = transformers_contender(ids, new)
    if isinstance(hf, str):
        section.skipped.append(hf)
    else:
        contenders[TRANSFORMERS] = hf[0]
    ctx.progress(f"timing {', '.join(contenders)}")
    measured = alternate(contenders, work=new, unit="tokens", repeats=ctx.options.repeats)
    section.measurements.extend(measured.values())
    for other in (LLAMA, TRANSFORMERS):
        if other in measured:
            section.ratios.append(ratio(measured[QKV], measured[other]))
    if LLAMA in measured and TRANSFORMERS in measured:
        section.ratios.append(ratio(measured[LLAMA], measured[TRANSFORMERS]))
    del model
    if not isinstance(hf, str):
        ctx.progress("qkv float32 (compiled) greedy tokens against transformers'")
        exact, _, exact_setup = load_for_generation("smollm2", precision="float32")
        warm_up(exact, setup=exact_setup)
        ours = generate(exact, ids, new, setup=exact_setup)[0, ids.shape[1]:].tolist()
        theirs = hf[0]()
        section.facts[f"qkv float32 ({exact_setup.describe()}) greedy tokens equal to transformers float32"] = (
            ours == theirs)
        section.facts["float32 greedy tokens agreeing"] = f"{sum(a == b for a, b in zip(ours, theirs))}/{new}"
        del exact
    ctx.progress("time to first token: a fresh process, empty then warm caches")
    with tempfile.TemporaryDirectory(prefix="qkv-inductor-") as cache:
        section.facts["fresh process, empty caches"] = first_token(ids_list, threads, Path(cache))
        section.facts["fresh process, warm caches"] = first_token(ids_list, threads, Path(cache))
    section.facts["gguf"] = smollm2_path().name
    section.facts["prompt tokens"] = s.smollm2_prompt
    section.facts["new tokens"] = new
    section.facts["threads"] = threads
    return section
