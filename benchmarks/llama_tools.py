"""llama.cpp's own tools as the benchmarks' peers: where they are, and the calls more than one
script makes (llama-bench's decode rate, llama-server's command line).

The tools are built once into $QKV_PEERS/build/bin (default /work/peers/build/bin) from the
llama.cpp that llama-cpp-python's source distribution vendors, with this CPU's flags:
benchmarks/README.md, "llama.cpp's tools", gives the commands. Every script that needs one
takes its path (--llama-bench, --llama-server, --llama-bin) and defaults to that folder.

(Not named llama_cpp.py: that is llama-cpp-python's module, which vs_llama_cpp.py imports.)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

PEERS = Path(os.environ.get("QKV_PEERS", "/work/peers"))  # llama.cpp's source, its build, requantized files
BIN = PEERS / "build" / "bin"
SMOLLM2_Q4_K_M = PEERS / "smollm2-q4_k_m.gguf"  # llama-quantize --allow-requantize of the packaged Q4_1 file

HOW_TO_BUILD = "build llama.cpp's tools as benchmarks/README.md says (\"llama.cpp's tools\")"


def tool(name: str, given: str | Path | None = None) -> Path:
    """The path of llama.cpp's `name` (llama-bench, llama-server, ...): `given` if it is a
    file, else BIN/name, else `name` on PATH; exits with a one-line message otherwise."""
    candidates = [Path(given)] if given is not None else [BIN / name]
    on_path = shutil.which(name) if given is None else None
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise SystemExit(f"no {name} at {candidates[0]}: {HOW_TO_BUILD}, or give its path")


def bench_rate(binary: str | Path, model: str | Path, threads: int, tokens: int = 128, timeout: float = 900) -> float:
    """llama-bench's pure decode, `-p 0 -n tokens -t threads`: the median over its repetitions
    of their average tokens/s (avg_ts)."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", "0", "-n", str(tokens), "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, timeout=timeout, check=True)
    return float(statistics.median(run["avg_ts"] for run in json.loads(out.stdout)))


def prompt_rate(binary: str | Path, model: str | Path, threads: int, tokens: int = 512, timeout: float = 900) -> float:
    """llama-bench's prompt processing, `-p tokens -n 0 -t threads` (its ppN): the median of
    its repetitions' average tokens/s."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(tokens), "-n", "0", "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, timeout=timeout, check=True)
    return float(statistics.median(run["avg_ts"] for run in json.loads(out.stdout)))


def file_bytes_per_token(model: str | Path) -> int:
    """Bytes of a GGUF file's tensors that llama.cpp reads per decoded token: every tensor,
    except that an embedding table that is not also the output head is read one row a token."""
    from gguf import GGUFReader

    tensors = {t.name: (int(t.n_bytes), int(t.shape[-1])) for t in GGUFReader(str(model)).tensors}  # shape: ggml order
    total = sum(nbytes for nbytes, _ in tensors.values())
    if "token_embd.weight" in tensors and "output.weight" in tensors:
        nbytes, rows = tensors["token_embd.weight"]
        total -= nbytes - nbytes // rows
    return total


def server_command(binary: str | Path, model: str | Path, port: int, *, threads: int, slots: int = 8,
                   context: int = 8192, extra: Sequence[str] = ()) -> list[str]:
    """llama-server on 127.0.0.1:`port` with `slots` parallel sequences sharing `context` tokens."""
    return [str(binary), "-m", str(model), "-t", str(threads), "-np", str(slots), "-c", str(context),
            "--host", "127.0.0.1", "--port", str(port), *extra]
