"""SmolLM2-135M-Instruct decode: qkv vs transformers (same dequantized weights) vs llama.cpp.

    .venv/bin/python benchmarks/smollm2.py [--new-tokens 128] [--repeats 3] [--threads 2]

Every contender runs in its own fresh interpreter, so its resident memory is its own:
  qkv           qkv.load_pretrained("smollm2"): the GGUF dequantized to float32 / bfloat16,
                prepared as `qkv generate` prepares it (qkv.perf.prepare_for_decoding);
                qkv-compiled adds --compile, qkv-int8-compiled --quantize int8 too (bfloat16
                activations); the untimed warm-up run includes the compilation
  transformers  AutoModelForCausalLM.from_pretrained(folder, gguf_file=...), which
                dequantizes the same file to bit-identical tensors (tests/models/test_gguf.py)
  llama.cpp     llama-cpp-python on the original Q4_1 file (optional: skipped with a message
                when `llama_cpp` is not installed)
Same chat-formatted prompt, exactly N greedy new tokens (end tokens do not stop it), batch 1,
the same number of threads. tokens/s = N / wall time of the whole call (prefill included),
median of the repeats after one warm-up. RSS: resident memory after generating (VmRSS) and
the peak over the process's life (VmHWM, loading included). Ratios are from the same run.

Shape legend: T prompt tokens, N new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."
CONTENDERS = ("qkv", "qkv-compiled", "qkv-int8-compiled", "transformers", "llama.cpp")
DTYPES = ("float32", "bfloat16")


def status_mib(key: str) -> float:
    """VmRSS (resident now) or VmHWM (resident peak) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def chat_prompt_ids() -> list[int]:
    """The prompt as one user message through the model's own chat template."""
    from qkv.chat import ChatTemplate
    from qkv.models.gguf import read_gguf

    ck = read_gguf("smollm2")
    text = ChatTemplate(ck.chat_template, bos_token=ck.bos_token, eos_token=ck.eos_token).render(
        [{"role": "user", "content": PROMPT}]
    )
    return ck.tokenizer.encode(text, add_special_tokens=False).ids


def worker(contender: str, dtype_name: str, ids: list[int], new: int, repeats: int, threads: int) -> dict:
    """Runs in the fresh interpreter: load, warm up, time `repeats` generations."""
    import torch

    torch.set_num_threads(threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    prompt = torch.tensor([ids])  # (1, T)

    if contender.startswith("qkv"):
        import qkv
        from qkv.perf import prepare_for_decoding

        model, _ = qkv.load_pretrained("smollm2", dtype=dtype)
        prepare_for_decoding(model, compile="compiled" in contender,
                             quantize="int8" if "int8" in contender else None)

        def run() -> list[int]:
            return qkv.generate(model, prompt, new)[0, len(ids):].tolist()

    elif contender == "transformers":
        import transformers

        from qkv.models.gguf import smollm2_path

        path = smollm2_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype
        ).eval()

        def run() -> list[int]:
            with torch.inference_mode():
                out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     pad_token_id=2)
            return out[0, len(ids):].tolist()

    else:  # llama.cpp on the Q4_1 file itself
        from llama_cpp import Llama

        from qkv.models.gguf import smollm2_path

        model = Llama(str(smollm2_path()), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                      n_batch=512, verbose=False)

        def run() -> list[int]:
            model.reset()
            out: list[int] = []
            for token in model.generate(ids, top_k=1, temp=0.0, reset=True):
                out.append(int(token))
                if len(out) == new:
                    break
            return out

    run()  # warm-up
    times, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - start)
    assert len(tokens) == new, f"{contender} made {len(tokens)} tokens, not {new}"
    return {
        "contender": contender,
        "dtype": dtype_name if contender != "llama.cpp" else "Q4_1",
        "tokens_per_s": new / statistics.median(times),
        "runs_s": times,
        "rss_mib": status_mib("VmRSS"),
        "peak_rss_mib": status_mib("VmHWM"),
        "tokens": tokens,
    }


def spawn(contender: str, dtype: str, ids: list[int], args: argparse.Namespace) -> dict | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", contender, "--dtype", dtype, "--ids", json.dumps(ids),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0 or not out.exists():
            print(f"{contender} {dtype} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per contender")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = worker(args.worker, args.dtype, json.loads(args.ids), args.new_tokens, args.repeats, args.threads)
        args.out.write_text(json.dumps(result))
        return

    import importlib.util

    ids = chat_prompt_ids()
    runs = [(c, d) for d in DTYPES for c in ("qkv", "qkv-compiled", "transformers")]
    runs.append(("qkv-int8-compiled", "bfloat16"))
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: skipped (llama-cpp-python is not installed; see benchmarks/RESULTS.md for "
              "the build flags that work on these machines)", file=sys.stderr)
    else:
        runs.append(("llama.cpp", "float32"))
    results = []
    for contender, dtype in runs:
        print(f"running {contender} {dtype} ...", file=sys.stderr)
        result = spawn(contender, dtype, ids, args)
        if result is not None:
            results.append(result)

    by = {(r["contender"], r["dtype"]): r for r in results}
    print(f"\nSmolLM2-135M-Instruct, {len(ids)}-token prompt, {args.new_tokens} greedy tokens, batch 1, "
          f"{args.threads} threads, median of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print("| contender | weights | tokens/s | vs transformers (same dtype) | RSS MiB | peak RSS MiB |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        ref = by.get(("transformers", r["dtype"]))
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        print(f"| {r['contender']} | {r['dtype']} | {r['tokens_per_s']:.1f} | {ratio} | "
              f"{r['rss_mib']:.0f} | {r['peak_rss_mib']:.0f} |")
    q, t = by.get(("qkv", "float32")), by.get(("transformers", "float32"))
    if q and t:
        print(f"qkv float32 tokens identical to transformers float32: {q['tokens'] == t['tokens']}")
    lc = by.get(("llama.cpp", "Q4_1"))
    if lc and q:
        print(f"llama.cpp Q4_1 / qkv float32: {lc['tokens_per_s'] / q['tokens_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
