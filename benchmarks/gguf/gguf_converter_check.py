"""Check tests/models/gguf/gguf_convert.py and qkv's GGUF reader against llama.cpp's own converter.

The tests write GGUF files with the `gguf` package following llama.cpp's
`convert_hf_to_gguf.py`, because CI has no llama.cpp checkout. This script is the by-hand
check that they follow it: for a tiny random model of every architecture qkv reads it runs
the real converter (`--outtype f32`) and compares its file with the test writer's (every
metadata key outside general.* and tokenizer.*, every tensor's name, type and bytes), then
reads the converter's file with qkv and compares every tensor with the source model's.

The converter needs a tokenizer it recognises; the models here carry a byte-level BPE
trained by `tokenizers`, so its vocabulary step is replaced by the plain GPT-2 one (the
tokenizer is not what is checked here).

    python benchmarks/gguf/gguf_converter_check.py --converter PATH/TO/convert_hf_to_gguf.py

The converter is the one vendored in llama-cpp-python's source distribution
($QKV_PEERS/src/llama_cpp_python-<version>/vendor/llama.cpp/convert_hf_to_gguf.py when unpacked
as benchmarks/README.md says). Nothing is timed; the machine's facts head the output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ROOT = harness.ROOT
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this tree's qkv, and its tests' GGUF writer

from qkv.models.gguf.checkpoint import read_gguf  # noqa: E402
from tests.models.conftest import make_tokenizer  # noqa: E402
from tests.models.gguf.gguf_convert import write_gguf  # noqa: E402
from tests.models.gguf.test_arch import KINDS, _source  # noqa: E402

# Runs the converter with its vocabulary step replaced by the GPT-2 BPE one (see above).
DRIVER = """
import importlib, runpy, sys
converter = sys.argv.pop(1)
root = converter.rsplit("/", 1)[0]
sys.argv[0] = converter
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt2"
for name in ("gemma", "phi", "llama", "qwen", "olmo", "gpt2"):
    for value in vars(importlib.import_module("conversion." + name)).values():
        if isinstance(value, type) and issubclass(value, base.TextModel) and "set_vocab" in vars(value):
            value.set_vocab = lambda self: self._set_vocab_gpt2()
runpy.run_path(converter, run_name="__main__")
"""

EXTRA = {  # settings the converter handles specially, besides each kind's defaults
    "gemma3_linear": ("gemma3", dict(num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=64, partial_rotary_factor=0.75,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                                                    "long_factor": [1.0 + i for i in range(6)],
                                                    "short_factor": [1.0 + 0.125 * i for i in range(6)],
                                                    "original_max_position_embeddings": 64})),
}


def _contents(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(str(path))
    keys = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("general.", "tokenizer.", "GGUF."))}
    tensors = {t.name: (t.tensor_type, np.array(t.data)) for t in reader.tensors}
    return keys, tensors


def check(kind: str, overrides: dict, converter: Path, folder: Path) -> str:
    if kind == "gpt2":  # the converter reads GPT-2's context length from n_ctx, which transformers 5 saves only when set
        overrides = {"n_ctx": 96, **overrides}
    model = _source(kind, **overrides)
    if model.config.model_type == "qwen2":  # transformers' Qwen2 tokenizer adds a token: leave room for it
        model = _source(kind, vocab_size=296, **overrides)
    model.save_pretrained(folder)
    make_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    theirs_path = folder / "converter.gguf"
    done = subprocess.run([sys.executable, "-c", DRIVER, str(converter), str(folder), "--outtype", "f32",
                           "--outfile", str(theirs_path)], capture_output=True, text=True)
    if done.returncode:
        return f"converter failed: {done.stderr.strip().splitlines()[-1]}"
    mine_keys, mine_tensors = _contents(write_gguf(folder / "tests.gguf", model, make_tokenizer()))
    their_keys, their_tensors = _contents(theirs_path)
    keys_equal = mine_keys == their_keys
    tensors_equal = mine_tensors.keys() == their_tensors.keys() and all(
        mine_tensors[n][0] == their_tensors[n][0] and np.array_equal(mine_tensors[n][1], their_tensors[n][1])
        for n in their_tensors)
    read = read_gguf(theirs_path).state_dict
    source = {n: v.float() for n, v in model.state_dict().items()
              if not (n == "lm_head.weight" and model.config.tie_word_embeddings)}
    names_equal = sorted(read) == sorted(source)
    worst = max(float((read[n] - v).abs().max()) for n, v in source.items()) if names_equal else float("nan")
    return (f"metadata equal: {keys_equal}, tensors equal: {tensors_equal} ({len(their_tensors)}), "
            f"qkv reads the converter's file as the source model: names {names_equal}, max |diff| {worst:.3g}")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    args = parser.parse_args()
    harness.header("GGUF files of the tests' writer against llama.cpp's converter", packages=("gguf", "transformers"))
    cases = {k: (k, {}) for k in KINDS if k not in ("qwen3_plain", "gpt2_1024")} | EXTRA
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, overrides) in cases.items():
            folder = Path(tmp) / name
            folder.mkdir()
            print(f"{name:14s} {check(kind, overrides, args.converter, folder)}", flush=True)


if __name__ == "__main__":
    main()
