"""A GGUF file's tensors dequantized and put back as Hugging Face holds them: renamed, q/k rows
in rotate-half order, Gemma's norm weights less the 1 the converter added, GPT-2's Conv1D
matrices transposed back. Blocks are decoded by qkv.models.gguf.dequantize (torch operations on
the block bytes) or, for the types it lacks, by the `gguf` library.

Shape legend: C embedding (hidden size), H heads, D head size, R rows of a projection (H*D).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.gguf import arch as gguf_arch
from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf.layout import gguf_shape, rope_heads, rows_in_hf_order, unpermute_rows


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Hugging Face name of a GGUF tensor of architecture `arch`, None when qkv does not know it."""
    return gguf_arch.ARCHITECTURES[arch].hf_name(gguf_name)


def dequantize(tensor: Any, path: Path) -> np.ndarray:
    """One GGUF tensor as a float32 array in PyTorch's (out, in) shape, by the gguf library."""
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise QkvError(
            f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, a type the gguf "
            "library cannot dequantize; use a file quantized as F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1 or a K-quant"
        ) from None
    try:
        return values.reshape(gguf_shape(tensor)).astype(np.float32, copy=False)
    except ValueError:
        raise QkvError(f"{path}: tensor {tensor.name} holds {values.size} values, not its shape {gguf_shape(tensor)}") from None


def tensor_shapes(reader: Any, config: dict[str, Any], path: Path) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor, from the file's header (nothing is read)."""
    arch = gguf_arch.architecture(reader, path)
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in arch.weights(reader.tensors):
        name = arch.hf_name(tensor.name)
        layer = None if name is None else arch.layer_of(name)
        if name is None or (layer is not None and layer >= layers):
            raise QkvError(f"{path}: unexpected tensor {str(tensor.name)[:80]!r} for a {layers}-layer {arch.name} model")
        if name in shapes:
            raise QkvError(f"{path}: tensor {tensor.name!r} appears twice")
        shape = gguf_shape(tensor)
        shapes[name] = shape[::-1] if arch.is_transposed(tensor.name, len(shape)) else shape
    return shapes


def _dequantize_one(tensor: Any, path: Path) -> Tensor:
    """One tensor as float32 in its (out, in) shape, by qkv's block decoder or the gguf library."""
    if tensor.tensor_type in gguf_blocks.TYPES:
        return gguf_blocks.dequantize_blocks([tensor.data], tensor.tensor_type).view(gguf_shape(tensor))
    return torch.from_numpy(np.array(dequantize(tensor, path)))


def read_state_dict(
    reader: Any, config: dict[str, Any], path: Path, dtype: torch.dtype, skip: frozenset[str] = frozenset()
) -> dict[str, Tensor]:
    """Every tensor (but those named in `skip`) dequantized, renamed and put back as Hugging
    Face holds it (q/k rows unpermuted, Gemma's norm weights less the 1 the converter added,
    GPT-2's Conv1D matrices transposed back); an unknown one -> QkvError.
    (qkv.models.gguf.stored reads the skipped ones as blocks.)

    Tensors of the types `qkv.models.gguf.dequantize` decodes are decoded together, one batch
    per type, and come back as views into that batch's one tensor (each contiguous); the
    rest, and the shifted norms (subtracted in float32 before any cast), one by one.
    """
    arch = gguf_arch.architecture(reader, path)
    tensor_shapes(reader, config, path)
    state: dict[str, Tensor] = {}
    batches: dict[Any, list[tuple[str, Any]]] = {}
    for tensor in arch.weights(reader.tensors):
        name = arch.hf_name(tensor.name)
        if name in skip:
            continue
        heads = rope_heads(name, config, arch)
        if tensor.tensor_type in gguf_blocks.TYPES and not arch.is_shifted_norm(tensor.name):
            batches.setdefault(tensor.tensor_type, []).append((name, tensor))
            continue
        weight = _dequantize_one(tensor, path)
        if heads is not None:
            weight = unpermute_rows(weight, heads)
        if arch.is_shifted_norm(tensor.name):
            weight = weight - arch.norm_shift
        state[name] = weight.to(dtype).contiguous()
    for tensor_type, members in batches.items():
        parts = [rows_in_hf_order(t.data, rope_heads(name, config, arch)) for name, t in members]
        try:
            flat = gguf_blocks.dequantize_blocks(parts, tensor_type).to(dtype)  # (all weights,)
        except ValueError as error:  # the header checked sizes; this is the last guard
            raise QkvError(f"{path}: the {tensor_type.name} tensors cannot be decoded: {error}") from None
        sizes = [t.n_elements for _, t in members]
        if flat.numel() != sum(sizes):
            raise QkvError(f"{path}: the {tensor_type.name} tensors hold {flat.numel()} values, not {sum(sizes)}")
        for (name, t), values in zip(members, flat.split(sizes)):
            state[name] = values.view(gguf_shape(t))
    for tensor in arch.weights(reader.tensors):
        name = arch.hf_name(tensor.name)
        if name not in skip and arch.is_transposed(tensor.name, len(tensor.shape)):  # (out, in) -> Conv1D's (in, out)
            state[name] = state[name].t().contiguous()
    names = (arch.hf_name(t.name) for t in arch.weights(reader.tensors))
    return {name: state[name] for name in names if name not in skip}  # the file's order

