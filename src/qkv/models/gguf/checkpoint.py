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
from qkv.models.gguf.scales import check_finite
from qkv.util.checked_memo import check_once
from qkv.models.gguf.stored import is_projection, read_stored_state
from qkv.models.gguf.tensors import read_state_dict, tensor_shapes
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
        check_once(self.path, check_finite, self.reader.tensors, self.path)  # once per file version
        return read_state_dict(self.reader, self.config, self.path, dtype)

    def read_stored(self, dtype: torch.dtype = torch.float32, *, embedding: bool = False) -> Any:
        """The projection matrices as stored blocks, the rest dequantized (qkv.models.gguf.stored);
        embedding=True keeps the embedding table's blocks too. Either way every block scale
        is checked finite first (qkv.models.gguf.scales): stored blocks are never decoded whole."""
        check_once(self.path, check_finite, self.reader.tensors, self.path)  # once per file version
        keep = (lambda name: is_projection(name) or name == "model.embed_tokens.weight") if embedding else is_projection
        return read_stored_state(self.reader, self.config, self.path, dtype, keep=keep)

    @property
    def stored_bytes(self) -> int:
        """Memory the tensors take read as `read_stored(embedding=True)` keeps them: the block
        matrices' bytes as stored, every other tensor as float32."""
        total = 0
        for t in self.reader.tensors:
            blocks = len(t.shape) == 2 and gguf_blocks.whole_blocks(t.tensor_type, int(t.shape[0]))
            total += int(t.n_bytes) if blocks else 4 * int(np.prod(t.shape))
        return total

    @property
    def stored_in_blocks(self) -> bool:
        """Whether every matrix of the repeated layers is stored in a GGUF block type (a Q4_K_M,
        Q5_0, Q8_0... file, or F16 / BF16 in rows of whole 32s), which qkv's block products
        multiply as stored (qkv.runtime.linear.block)."""
        layers = [t for t in self.reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        return bool(layers) and all(gguf_blocks.whole_blocks(t.tensor_type, int(t.shape[0])) for t in layers)

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
