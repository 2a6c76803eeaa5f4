"""The >= 1B-parameter GGUF files the speed benchmarks run on, made here from random weights.

Speed does not depend on the weights' values, so the file is made, not downloaded: a
transformers `LlamaConfig` of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query heads,
8 key/value heads of 64, MLP 8192, tied embeddings, RoPE base 500,000 with llama3 scaling)
with SmolLM2's 49,152-token tokenizer (transformers reads it from the packaged SmolLM2 GGUF),
`save_pretrained` in bfloat16, then llama.cpp's own `convert_hf_to_gguf.py --outtype f16`
(from the vendored source, with its `gguf-py`) and `llama-quantize` to each type asked.

    .venv/bin/python benchmarks/gguf/llama_1b_files.py [--types Q4_K_M Q5_K_M Q6_K Q8_0] [--out DIR]

The low-bit IQ types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, and the mixes built on
them) need an importance matrix, which llama.cpp makes by running the model over text; for
random weights a uniform one (every input column weighted 1, llama.cpp's legacy imatrix
format) stands in: the file has the type's bytes and layout, which is all a speed
measurement reads.

Files land in `$QKV_PEERS/files` (default /work/peers/files) as `llama-1b-<type>.gguf`; one
already there is kept (delete it to make it anew). Each step writes to a temporary name and
renames it into place, so an interrupted run leaves no half file under the final name. About
5 minutes on 2 cores for the first type, under a minute for each further one. Never commit
the files (0.7-1.3 GB each).

Other scripts import `ensure(type)` to get a path, making the file when it is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: llama_tools
import llama_tools  # noqa: E402

FILES = llama_tools.PEERS / "files"
VENDOR = llama_tools.PEERS / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             head_dim=64, intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0,
             max_position_embeddings=131072, rms_norm_eps=1e-5,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                           "low_freq_factor": 1.0, "original_max_position_embeddings": 8192})


def path_of(kind: str, out: Path = FILES) -> Path:
    return out / f"llama-1b-{kind.lower()}.gguf"


def _checkpoint(folder: Path) -> None:
    """A random-weight Llama-3.2-1B-shaped checkpoint with SmolLM2's tokenizer in `folder`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qkv.models.loader import smollm2_path

    smol = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **SHAPE)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _f16(out: Path) -> Path:
    """The f16 GGUF every quantized type is made from (kept beside them)."""
    target = out / "llama-1b-f16.gguf"
    if target.is_file():
        return target
    converter = VENDOR / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise SystemExit(f"no {converter}: unpack llama-cpp-python's sdist as benchmarks/README.md says")
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        folder = Path(scratch) / "hf"
        print(f"making a random-weight 1B checkpoint in {folder}", flush=True)
        _checkpoint(folder)
        partial = Path(scratch) / "f16.gguf"
        env = {**os.environ, "PYTHONPATH": str(VENDOR / "gguf-py")}
        print("converting it with llama.cpp's convert_hf_to_gguf.py --outtype f16", flush=True)
        subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "f16", "--outfile", str(partial)],
                       env=env, check=True)
        os.replace(partial, target)
    return target


# the llama-quantize types that refuse to run without an importance matrix
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS")


def uniform_imatrix(source: Path, target: Path) -> Path:
    """An importance matrix of ones for every matrix of `source`, in llama.cpp's legacy format:
    int32 entry count; per entry int32 name length, name, int32 calls (1), int32 values, float32
    values; then int32 chunk count (1), int32 length and the dataset's name."""
    import struct

    from gguf import GGUFReader

    matrices = [(t.name, int(t.shape[0])) for t in GGUFReader(source).tensors if len(t.shape) == 2]
    with open(target, "wb") as f:
        f.write(struct.pack("<i", len(matrices)))
        for name, columns in matrices:
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, columns))
            f.write(struct.pack(f"<{columns}f", *([1.0] * columns)))
        f.write(struct.pack("<ii", 1, len(b"uniform")) + b"uniform")
    return target


def ensure(kind: str, out: Path = FILES) -> Path:
    """The file of `kind` (a llama-quantize type name), made when missing."""
    target = path_of(kind, out)
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    source = _f16(out)
    quantize = llama_tools.tool("llama-quantize")
    partial = target.with_name(target.name + ".partial")
    print(f"llama-quantize {source.name} -> {target.name} ({kind})", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        extra = ["--imatrix", str(uniform_imatrix(source, Path(folder) / "uniform.imatrix"))] if kind in NEEDS_IMATRIX else []
        subprocess.run([str(quantize), *extra, str(source), str(partial), kind], check=True, stdout=subprocess.DEVNULL)
    os.replace(partial, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=list(TYPES), help=f"llama-quantize types (default: {' '.join(TYPES)})")
    parser.add_argument("--out", type=Path, default=FILES, help=f"folder for the files (default: {FILES})")
    args = parser.parse_args()
    if shutil.disk_usage(args.out if args.out.exists() else args.out.parent).free < 8 << 30:
        raise SystemExit(f"less than 8 GiB free under {args.out}: the files and the f16 source take about 6")
    for kind in args.types:
        print(ensure(kind.upper(), args.out), flush=True)


if __name__ == "__main__":
    main()
