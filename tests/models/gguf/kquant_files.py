"""A tiny GGUF file in a Q4_K_M-like mix of block types, for parity with transformers' reading.

`gguf.quants.quantize` cannot make K-quant blocks, so a written f32 file (tests/models/
gguf_convert.py) is rewritten with each layer matrix replaced by random block bytes of the
type the mix gives it: random codes and sub-block scales, the float16 scales (and minimums)
set so the dequantized matrix has about the standard deviation `spread` (measured with
`gguf.quants.dequantize` on the same bytes). The weights are no longer the source model's:
the reference is what transformers and the `gguf` package read from the file. Norms, biases
and every 1-D tensor stay F32, as in a real Q4_K_M file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from qkv.models.gguf import dequantize as gguf_blocks

# Per layer matrix, the types of even and odd layers (Q4_K_M keeps Q6_K for half of attn_v and
# ffn_down); the embedding is Q8_0 as in Gemma 3 270M's Q4_K_M file (its head is tied).
MIX: dict[str, tuple[Q, Q]] = {
    "attn_q": (Q.Q4_K, Q.Q4_K), "attn_k": (Q.Q5_0, Q.Q4_K), "attn_v": (Q.Q6_K, Q.Q8_0),
    "attn_output": (Q.Q4_K, Q.Q5_0), "ffn_gate": (Q.Q4_K, Q.Q4_K), "ffn_up": (Q.Q5_0, Q.Q4_K),
    "ffn_down": (Q.Q6_K, Q.Q4_K), "token_embd": (Q.Q8_0, Q.Q8_0), "output": (Q.Q6_K, Q.Q6_K),
}


def _block_type(name: str) -> Q | None:
    parts = name.split(".")
    if parts[0] == "blk":
        mix = MIX.get(parts[2])
        return None if mix is None else mix[int(parts[1]) % 2]
    mix = MIX.get(parts[0])
    return None if mix is None else mix[0]


def random_blocks(block_type: Q, shape: tuple[int, ...], rng: np.random.Generator, spread: float) -> np.ndarray:
    """Random bytes of `block_type` for a (rows, columns) matrix, rows of bytes (as the gguf
    writer takes raw blocks), scaled so the weights have about standard deviation `spread`."""
    weights, size = gguf.GGML_QUANT_SIZES[block_type]
    rows, columns = shape
    if columns % weights:
        raise ValueError(f"{block_type.name} blocks hold {weights} weights: a row of {columns} is not whole blocks")
    raw = rng.integers(0, 256, size=(rows * columns // weights, size), dtype=np.uint8)
    halves = gguf_blocks.BLOCK_FORMATS[block_type].halves
    for start in halves:
        raw[:, start : start + 2] = np.ones((raw.shape[0], 1), np.float16).view(np.uint8)
    scale = spread / float(gguf.quants.dequantize(raw.reshape(rows, -1), block_type).std())
    for start in halves:  # a scale per block, of random sign and size around `scale`
        values = scale * rng.uniform(0.5, 1.5, size=(raw.shape[0], 1)) * rng.choice([-1.0, 1.0], size=(raw.shape[0], 1))
        raw[:, start : start + 2] = values.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def requantize(path: Path, *, seed: int = 0, spread: float = 0.08) -> dict[str, Q]:
    """Rewrite the f32 GGUF file at `path` with its matrices in the MIX (random blocks);
    return each rewritten tensor's block type."""
    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    fields = [(k, f.contents(), f.types) for k, f in reader.fields.items()
              if not k.startswith(("GGUF.", "general.architecture"))]
    tensors = [(t.name, np.array(t.data)) for t in reader.tensors]
    del reader
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value, types in fields:
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, types[0])
    written: dict[str, Q] = {}
    for name, data in tensors:
        block_type = _block_type(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if block_type is None or data.ndim != 2:
            writer.add_tensor(name, data)
            continue
        writer.add_tensor(name, random_blocks(block_type, data.shape, rng, spread), raw_dtype=block_type)
        written[name] = block_type
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
