"""qkv's block products type by type against ggml's, at SmolLM2's and a 1B Llama's shapes: the
time of one product y (M, N) = x (M, K) @ w^T (M = 1: a decode step; --rows 512: a prompt's
prefill, qkv's tiles against ggml's multi-row paths), w in each GGUF block type, for
every variant this CPU runs (generic C++, AVX2, AVX-512), one and two threads, next to ggml's
own `ggml_mul_mat` on the same shapes and type (llama.cpp's CPU backend, built in /work/peers:
benchmarks/kernels/ggml_mul_mat.c, compiled here against its libggml; left out when that build
is missing). Both sides include rounding the activations to the type's `vec_dot_type`.

    python benchmarks/kernels/block_types.py [--types Q4_K,Q6_K] [--calls 200] [--rows 1] [--json out.json]

The types qkv repacks at load (qkv.runtime.native.repacked's REPACKED: Q4_K, Q5_K, Q8_0, Q5_0) get
a second line, "Q4_K/r" ...: qkv's rows repacked against ggml's repacked ones where it has them
(its CPU_REPACK buffer, as llama.cpp loads a model: benchmarks/kernels/ggml_repacked_mul_mat.c;
on x86 only Q4_K: for the others ggml's plain line is the one to compare). `--rows M` times M activation rows a product
(a prompt's prefill) instead of one.

Each cell: the median of `calls` calls after 20 untimed, random blocks with small float16
scales (speed does not depend on the values). The weights of the larger shapes (8 MB and up
as Q4_K) do not fit in cache, as in a decode step; the 2048 x 2048 ones nearly do.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import llama_tools  # noqa: E402
from qkv.models.gguf.dequantize import BLOCK_FORMATS  # noqa: E402
from qkv.runtime.native.block_ops import block_linear, block_products_status  # noqa: E402
from qkv.runtime.native.ops import use_variant, variants  # noqa: E402
from qkv.runtime.native.repacked import REPACKED, repack, repack_status  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048), (8192, 2048), (2048, 8192)]  # (N, K)
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.Q2_K, Q.Q3_K]
GGML_BENCH = Path(__file__).with_name("ggml_mul_mat.c")
GGML_REPACKED_BENCH = Path(__file__).with_name("ggml_repacked_mul_mat.c")


def random_matrix(block_type: Q, n: int, k: int) -> torch.Tensor:
    form = BLOCK_FORMATS[block_type]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n * k // form.weights, form.size), dtype=np.uint8)
    for start in form.halves:
        raw[:, start : start + 2] = rng.normal(scale=0.02, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def qkv_us(block_type: Q, n: int, k: int, threads: int, variant: str, calls: int, rows: int, repacked: bool = False) -> float:
    blocks, x = random_matrix(block_type, n, k), torch.randn(rows, k)
    code = int(block_type)
    if repacked:
        blocks, code = repack(blocks, block_type), REPACKED[block_type]
    torch.set_num_threads(threads)
    samples = []
    with use_variant(variant):
        for i in range(calls + 20):
            start = time.perf_counter()
            block_linear(x, blocks, code)
            if i >= 20:
                samples.append(time.perf_counter() - start)
    return harness.median(samples) * 1e6


def ggml_binary(lib: Path, source: Path = GGML_BENCH) -> Path | None:
    """`source` (ggml_mul_mat.c) built against the libggml in `lib` (the peers' llama.cpp build by
    default), or None where that is missing."""
    include = llama_tools.PEERS / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "ggml" / "include"
    if not (lib / "libggml.so").exists() or not include.is_dir():
        return None
    key = hashlib.sha1(str(lib.resolve()).encode() + source.read_bytes()).hexdigest()[:12]
    target = Path(os.environ.get("TMPDIR", "/tmp")) / f"qkv_{source.stem}_{key}"
    command = ["cc", "-O2", str(source), f"-I{include}", f"-L{lib}", "-lggml", "-lggml-base", "-lggml-cpu",
               f"-Wl,-rpath,{lib}", "-o", str(target)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"ggml's side left out: its benchmark did not build ({done.stderr.strip().splitlines()[:1]})", flush=True)
        return None
    return target


def ggml_us(binary: Path, block_type: Q, n: int, k: int, threads: int, calls: int, rows: int,
            repacked: bool = False) -> float:
    """ggml_mul_mat's median for `rows` activation rows, or ggml_repacked_mul_mat's (repacked weights)."""
    shape = [str(n), str(k), str(rows), str(threads), str(calls)] if repacked else [str(n), str(k), str(threads), str(calls), str(rows)]
    done = subprocess.run([str(binary), str(int(block_type)), *shape],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return float("nan")
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--types", help="comma-separated block types (default: all)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rows", type=int, default=1, help="M, the rows of x (512: a prompt's prefill)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: %(default)s)")
    parser.add_argument("--variants", help="comma-separated variants to time (default: every one this CPU runs)")
    parser.add_argument("--shapes", help="comma-separated NxK (default: SmolLM2's and a 1B Llama's)")
    parser.add_argument("--ggml-lib", type=Path, default=llama_tools.BIN,
                        help="the folder of the libggml*.so to time (default: the peers' build, %(default)s)")
    args = parser.parse_args()
    reason = block_products_status()
    if reason is not None:
        sys.exit(f"qkv's block products are not available here: {reason}")
    facts = harness.header("block products per type: qkv's variants against ggml's mul_mat", packages=("gguf",))
    types = [Q[name] for name in args.types.split(",")] if args.types else TYPES
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    timed = [v for v in variants() if args.variants is None or v in args.variants.split(",")]
    binary, repacked_binary = ggml_binary(args.ggml_lib), ggml_binary(args.ggml_lib, GGML_REPACKED_BENCH)
    if binary is None:
        print("ggml's side left out: no llama.cpp build at", args.ggml_lib, flush=True)
    rows = []
    for block_type in types:
        kinds = [False, True] if block_type in REPACKED and repack_status() is None else [False]
        for n, k in shapes:
            if k % BLOCK_FORMATS[block_type].weights:  # SmolLM2's 576 is not whole super-blocks
                continue
            for threads in (int(t) for t in args.threads.split(",")):
                for repacked in kinds:
                    name = block_type.name + ("/r" if repacked else "")
                    row = {"type": name, "N": n, "K": k, "M": args.rows, "threads": threads}
                    for variant in timed:
                        row[variant] = qkv_us(block_type, n, k, threads, variant, args.calls, args.rows, repacked)
                    ggml = repacked_binary if repacked else binary
                    if ggml is not None:
                        row["ggml"] = ggml_us(ggml, block_type, n, k, threads, args.calls, args.rows, repacked)
                    best = row[timed[-1]]
                    ratio = f"  ggml/qkv x{row['ggml'] / best:4.2f}" if "ggml" in row else ""
                    cells = "  ".join(f"{v} {row[v]:8.1f}" for v in (*timed, *(["ggml"] if "ggml" in row else [])))
                    print(f"{name:6} {n:5}x{k:<5} M={args.rows} t={threads}  us/product: {cells}{ratio}", flush=True)
                    rows.append(row)
    torch.set_num_threads(1)
    if args.json:
        harness.write_json(args.json, {"products": rows}, facts)


if __name__ == "__main__":
    main()
