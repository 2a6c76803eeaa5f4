"""Models from GGUF files (llama.cpp's format), read into what the Hugging Face side loads.

A GGUF file holds everything a model needs in one place: the hyperparameters as metadata
(`llama.block_count`, `gemma3.attention.sliding_window`, ...), the tokenizer (tokens, merges,
special ids, chat template) and the tensors, usually quantized (Q4_1, Q8_0, ...). This module
turns it into what the Hugging Face side of qkv already loads: a `config.json`-style dict,
fp32/bf16 tensors under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`) and a
`tokenizers.Tokenizer`. What each architecture means (its config.json, its tensor names, the
transforms llama.cpp's converter applied) is `qkv.models.gguf.arch`; the transforms are undone
here: the llama-ordered q/k rows (the converter reorders the rows of every head from the
rotate-half RoPE layout, first half then second half, into the interleaved one, pairs of
neighbouring rows; `unpermute_rows` puts them back), Gemma's norm weights + 1, GPT-2's
transposed Conv1D matrices.

This module only reads GGUF files; `qkv.models.loader` (the one loader) finds them by name
and builds the model. The header (metadata and tensor table) is parsed by
`qkv.models.gguf.header`, the tensors are dequantized by `qkv.models.gguf.dequantize` (torch
operations on the block bytes) or, for the types it lacks, by the `gguf` library. Everything
in the file is checked before it is used: the architecture, metadata types and ranges, token
ids, tensor names and shapes (from the header, before any dequantizing).

Shape legend: V vocabulary, C embedding (hidden size), F feed-forward size, H query heads,
H_kv key/value heads, D head size, R rows of a projection (H*D or H_kv*D).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.gguf import arch as gguf_arch
from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf.tokenizer import read_tokenizer  # both kinds: byte-level BPE and SentencePiece
from qkv.models.configs.fields import is_int

GGUF_MAGIC = b"GGUF"

SUPPORTED_ARCHITECTURES = tuple(gguf_arch.ARCHITECTURES)


@dataclass(frozen=True)
class GGUFCheckpoint:
    """What a GGUF file holds, in Hugging Face form."""

    path: Path
    config: dict[str, Any]  # as config.json would say it
    state_dict: dict[str, Tensor]  # Hugging Face names, q/k rows in rotate-half order
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None


# ----------------------------------------------------------------------------- locating


def resolve_gguf(path: str | os.PathLike[str]) -> Path:
    """A .gguf file, or a folder holding exactly one .gguf file -> the file.

    (Names such as `smollm2` are resolved by qkv.models.loader, the one loader.)
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(found) != 1:
            what = "no .gguf file" if not found else f"{len(found)} .gguf files"
            raise QkvError(f"{path} holds {what}; pass the path of the one .gguf file to load")
        return found[0]
    if not path.is_file():
        raise QkvError(f"{path} does not exist; pass a .gguf file or a folder holding one")
    return path


def is_gguf_file(path: Path) -> bool:
    """A file whose first bytes are GGUF's magic."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


# ----------------------------------------------------------------------------- reading


def open_gguf(path: Path) -> Any:
    """The header of `path` (qkv.models.gguf.header); a file that is not GGUF or is cut short -> QkvError."""
    from qkv.models.gguf.header import GGUFFormatError, GGUFTruncatedError, read_header

    try:
        return read_header(path)
    except GGUFTruncatedError as error:
        raise QkvError(f"{path} is truncated: {error}") from None
    except (GGUFFormatError, OSError) as error:
        raise QkvError(
            f"{path} is not a readable GGUF file ({type(error).__name__}: {error}); "
            "it may be truncated or not a GGUF file at all: download it again"
        ) from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as error:  # the reader's own view of a malformed field
        raise QkvError(f"metadata key {key!r} cannot be read ({type(error).__name__})") from None


def _required(reader: Any, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise QkvError(f"{path} lacks the metadata key {key!r}; the file was not written for llama.cpp's llama loader")
    return value


def _token_id(reader: Any, key: str, path: Path, count: int) -> int | None:
    value = _field(reader, key)
    if value is None:
        return None
    if not is_int(value) or not 0 <= value < count:
        raise QkvError(f"{path}: {key} is {str(value)[:40]}, not a token id between 0 and {count - 1}")
    return value


def read_config(reader: Any, path: Path) -> dict[str, Any]:
    """The model's hyperparameters as the family's config.json dict (qkv.models.gguf.arch), each value checked."""
    return gguf_arch.read_config(reader, path)


def unpermute_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order: interleaved RoPE pairs -> rotate-half halves.

    Within each head llama.cpp stores rows as (pair 0: row 0, row D/2), (pair 1: row 1,
    row D/2 + 1), ...; Hugging Face (and qkv) keep the first halves, then the second halves.
    """
    rows, cols = weight.shape
    d_half = rows // num_heads // 2
    w = weight.reshape(num_heads, d_half, 2, cols)  # (H, D/2, 2, C): GGUF's pairs
    return w.transpose(1, 2).reshape(rows, cols)  # (H, 2, D/2, C) -> (R, C)


def permute_rows(weight: Tensor, num_heads: int) -> Tensor:
    """llama.cpp's q/k row order from the rotate-half one (the inverse of `unpermute_rows`)."""
    rows, cols = weight.shape
    d_half = rows // num_heads // 2
    w = weight.reshape(num_heads, 2, d_half, cols)  # (H, 2, D/2, C): two halves per head
    return w.transpose(1, 2).reshape(rows, cols)  # (H, D/2, 2, C) -> (R, C)


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
        return values.reshape(_gguf_shape(tensor)).astype(np.float32, copy=False)
    except ValueError:
        raise QkvError(f"{path}: tensor {tensor.name} holds {values.size} values, not its shape {_gguf_shape(tensor)}") from None


def _gguf_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first


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
        shape = _gguf_shape(tensor)
        shapes[name] = shape[::-1] if arch.is_transposed(tensor.name, len(shape)) else shape
    return shapes


def _rope_heads(name: str, config: dict[str, Any], arch: gguf_arch.Architecture) -> int | None:
    """How many heads' rows llama.cpp reordered in this tensor (q and k of the llama-ordered
    architectures), else None."""
    if not arch.permuted_qk:
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return config["num_attention_heads"]
    if name.endswith("self_attn.k_proj.weight"):
        return config["num_key_value_heads"]
    return None


def _rows_in_hf_order(data: np.ndarray, heads: int | None) -> np.ndarray:
    """The tensor's stored rows, q/k ones put back in rotate-half order (`unpermute_rows`).

    A row of a GGUF tensor is whole blocks, so reordering rows of bytes before decoding
    gives the same values as reordering the decoded rows, for a sixth of the bytes moved.
    """
    if heads is None:
        return data
    order = unpermute_rows(torch.arange(data.shape[0])[:, None], heads)[:, 0]  # (R,): stored row per HF row
    return data[order.numpy()]  # (R, bytes per row), a copy


def _dequantize_one(tensor: Any, path: Path) -> Tensor:
    """One tensor as float32 in its (out, in) shape, by qkv's block decoder or the gguf library."""
    if tensor.tensor_type in gguf_blocks.TYPES:
        return gguf_blocks.dequantize_blocks([tensor.data], tensor.tensor_type).view(_gguf_shape(tensor))
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
        heads = _rope_heads(name, config, arch)
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
        parts = [_rows_in_hf_order(t.data, _rope_heads(name, config, arch)) for name, t in members]
        try:
            flat = gguf_blocks.dequantize_blocks(parts, tensor_type).to(dtype)  # (all weights,)
        except ValueError as error:  # the header checked sizes; this is the last guard
            raise QkvError(f"{path}: the {tensor_type.name} tensors cannot be decoded: {error}") from None
        sizes = [t.n_elements for _, t in members]
        if flat.numel() != sum(sizes):
            raise QkvError(f"{path}: the {tensor_type.name} tensors hold {flat.numel()} values, not {sum(sizes)}")
        for (name, t), values in zip(members, flat.split(sizes)):
            state[name] = values.view(_gguf_shape(t))
    for tensor in arch.weights(reader.tensors):
        name = arch.hf_name(tensor.name)
        if name not in skip and arch.is_transposed(tensor.name, len(tensor.shape)):  # (out, in) -> Conv1D's (in, out)
            state[name] = state[name].t().contiguous()
    names = (arch.hf_name(t.name) for t in arch.weights(reader.tensors))
    return {name: state[name] for name in names if name not in skip}  # the file's order


# ----------------------------------------------------------------------------- the whole file


@dataclass
class GGUFFile:
    """A GGUF file with its metadata checked and its tensors not yet dequantized."""

    path: Path
    reader: Any
    config: dict[str, Any]  # as config.json would say it
    shapes: dict[str, tuple[int, ...]]  # Hugging Face names
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    @property
    def read_bytes(self) -> int:
        """Memory the dequantized float32 tensors take while they are read."""
        return sum(4 * int(np.prod(s)) for s in self.shapes.values())

    def read_tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        return read_state_dict(self.reader, self.config, self.path, dtype)

    def read_stored(self, dtype: torch.dtype = torch.float32, *, embedding: bool = False) -> Any:
        """The projection matrices as stored blocks, the rest dequantized (qkv.models.gguf.stored);
        embedding=True keeps the embedding table's blocks too."""
        from qkv.models.gguf.stored import is_projection, read_stored_state

        keep = (lambda name: is_projection(name) or name == "model.embed_tokens.weight") if embedding else is_projection
        return read_stored_state(self.reader, self.config, self.path, dtype, keep=keep)

    @property
    def stored_bytes(self) -> int:
        """Memory the tensors take read as `read_stored(embedding=True)` keeps them: the block
        matrices' bytes as stored, every other tensor as float32."""
        total = 0
        for t in self.reader.tensors:
            blocks = t.tensor_type in gguf_blocks.BLOCK_FORMATS and len(t.shape) == 2
            total += int(t.n_bytes) if blocks else 4 * int(np.prod(t.shape))
        return total

    @property
    def stored_in_blocks(self) -> bool:
        """Whether every matrix of the repeated layers is stored in a GGUF block type (a Q4_K_M,
        Q5_0, Q8_0... file), which qkv's block products multiply as stored (qkv.runtime.linear.block)."""
        layers = [t for t in self.reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        return bool(layers) and all(t.tensor_type in gguf_blocks.BLOCK_FORMATS for t in layers)

    @property
    def stored_in_four_bits(self) -> bool:
        """Whether every matrix of the repeated layers is stored in 4-bit blocks (Q4_0 or
        Q4_1), which qkv's int4 layers hold without further loss."""
        layers = [t for t in self.reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        four_bits = {gguf_blocks.Q.Q4_0, gguf_blocks.Q.Q4_1}
        return bool(layers) and all(t.tensor_type in four_bits for t in layers)


def open_gguf_file(path_or_folder: str | os.PathLike[str]) -> GGUFFile:
    """Read and check the metadata, tokenizer and tensor shapes of a GGUF file."""
    path = resolve_gguf(path_or_folder)
    reader = open_gguf(path)
    config = read_config(reader, path)
    shapes = tensor_shapes(reader, config, path)
    tokenizer = read_tokenizer(reader, path)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise QkvError(f"{path}: tokenizer.chat_template must be a string")

    def token(key: str) -> str | None:
        index = _token_id(reader, key, path, len(tokens))
        return None if index is None else tokens[index]

    return GGUFFile(
        path=path, reader=reader, config=config, shapes=shapes, tokenizer=tokenizer, chat_template=template,
        bos_token=token("tokenizer.ggml.bos_token_id"), eos_token=token("tokenizer.ggml.eos_token_id"),
    )


def read_gguf(path_or_folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Config, every tensor (dequantized) and tokenizer of a GGUF file or a folder holding one."""
    file = open_gguf_file(path_or_folder)
    return GGUFCheckpoint(
        path=file.path, config=file.config, state_dict=file.read_tensors(dtype), tokenizer=file.tokenizer,
        chat_template=file.chat_template, bos_token=file.bos_token, eos_token=file.eos_token,
    )
