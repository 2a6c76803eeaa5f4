"""Hugging Face checkpoint folders in and out: config.json + safetensors + tokenizer.json.

    load_pretrained(path, dtype) -> (model, tokenizer)   a folder, or a GGUF file/name
    build_from_hf(config, tensors, dtype) -> model       config.json dict + HF-named tensors
    save_pretrained(model, tokenizer, path)              the same folder format, atomically

The tokenizer is a plain `tokenizers.Tokenizer` (encode(text).ids, decode(ids)).
Weights are read only with safetensors, never pickle. Every problem a user can fix (no
folder, unknown architecture, missing or unexpected weight, wrong shape, truncated file)
raises a QkvError that names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor

from qkv.atomic import atomic_write_with
from qkv.errors import QkvError
from qkv.models import hf_keys
from qkv.models.decoder import CausalDecoder
from qkv.models.gpt2 import GPTConfig, GPTModel
from qkv.models.llama import LlamaForCausalLM
from qkv.models.llama_config import LlamaConfig
from qkv.models.qwen import Qwen2Config, Qwen3Config

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
GGUF_NAMES = ("smollm2",)


@dataclass(frozen=True)
class Family:
    """One model_type: its architectures, how config.json becomes a model, its key map."""

    architectures: tuple[str, ...]
    build: Callable[[dict[str, Any]], CausalDecoder]
    load: Callable[[Any, dict[str, Tensor], str], None]


def _build_gpt2(config: dict[str, Any]) -> GPTModel:
    model = GPTModel(GPTConfig.from_hf_config(config))
    if config.get("tie_word_embeddings", True):
        model.tie_weights()
    return model


def _load_gpt2(model: GPTModel, tensors: dict[str, Tensor], source: str) -> None:
    if not any(k.startswith("transformer.") for k in tensors):
        # Saved from GPT2Model (no head): the same names without the "transformer." prefix.
        tensors = {k if k.startswith("lm_head.") else f"transformer.{k}": v for k, v in tensors.items()}
    tied = {"lm_head.weight": "transformer.wte.weight"} if model.weights_tied else {}
    hf_keys.load_mapped(
        model, hf_keys.gpt2_key_maps(model), tensors,
        skip=hf_keys.GPT2_BUFFERS, tied_duplicates=tied, source=source,
    )


def _load_llama(model: LlamaForCausalLM, tensors: dict[str, Tensor], source: str) -> None:
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.cfg.tie_word_embeddings else {}
    hf_keys.load_mapped(
        model, hf_keys.llama_key_maps(model), tensors,
        skip=hf_keys.LLAMA_BUFFERS, tied_duplicates=tied, source=source,
    )


FAMILIES: dict[str, Family] = {
    "gpt2": Family(("GPT2LMHeadModel", "GPT2Model"), _build_gpt2, _load_gpt2),
    "llama": Family(("LlamaForCausalLM",), lambda c: LlamaForCausalLM(LlamaConfig.from_hf_config(c)), _load_llama),
    "qwen2": Family(("Qwen2ForCausalLM",), lambda c: LlamaForCausalLM(Qwen2Config.from_hf_config(c)), _load_llama),
    "qwen3": Family(("Qwen3ForCausalLM",), lambda c: LlamaForCausalLM(Qwen3Config.from_hf_config(c)), _load_llama),
}


def _family(config: dict[str, Any], source: str) -> Family:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    known = ", ".join(a for f in FAMILIES.values() for a in f.architectures[:1])
    if family is None:
        raise QkvError(
            f"{source}: unknown architecture {architectures or '?'} (model_type {model_type!r}); "
            f"qkv loads {known}"
        )
    odd = [a for a in architectures if a not in family.architectures]
    if odd:
        raise QkvError(f"{source}: unknown architecture {', '.join(odd)} for model_type {model_type!r}; qkv loads {known}")
    return family


def _eos_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    """config.json's eos_token_id (int, list or null) as a tuple of ids inside the vocabulary."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(i) for i in ids if isinstance(i, int) and 0 <= i < vocab_size)


def build_from_hf(
    config: dict[str, Any], state_dict: dict[str, Tensor], dtype: torch.dtype = torch.float32,
    *, source: str = "checkpoint",
) -> CausalDecoder:
    """A qkv model in eval mode from a Hugging Face config.json dict and HF-named tensors."""
    family = _family(config, source)
    try:
        model = family.build(config)
    except QkvError:
        raise
    except (ValueError, TypeError) as error:
        raise QkvError(f"{source}: config.json is not usable: {error}") from None
    model.to(dtype)
    family.load(model, state_dict, source)
    vocab = int(config["vocab_size"])
    model.eos_token_ids = _eos_ids(config.get("eos_token_id"), vocab)
    return model.eval()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QkvError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise QkvError(f"{path} must hold a JSON object")
    return data


def _read_safetensors(path: Path, names: list[str] | None = None) -> dict[str, Tensor]:
    if not path.is_file():
        raise QkvError(f"weights file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys()) if names is None else names
            absent = [k for k in keys if k not in f.keys()]
            if absent:
                raise QkvError(f"{path} lacks {hf_keys.names_preview(absent)}, which {INDEX} places there")
            return {k: f.get_tensor(k) for k in keys}
    except QkvError:
        raise
    except Exception as error:  # safetensors reports truncation/corruption with its own types
        raise QkvError(f"{path} is truncated or corrupt ({error}); save or copy it again") from None


def read_weights(folder: Path) -> dict[str, Tensor]:
    """All tensors of a folder: model.safetensors, or the shards its index lists."""
    single, index = folder / WEIGHTS, folder / INDEX
    if single.exists():
        return _read_safetensors(single)
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QkvError(f"{index} has no weight_map")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        tensors: dict[str, Tensor] = {}
        for file, names in by_file.items():
            tensors.update(_read_safetensors(folder / file, names))
        return tensors
    pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = f" (found {', '.join(pickled)}: qkv never loads pickle files; convert to safetensors)" if pickled else ""
    raise QkvError(f"{folder} has neither {WEIGHTS} nor {INDEX}{hint}")


def read_tokenizer(folder: Path) -> Tokenizer:
    path = folder / TOKENIZER
    if not path.is_file():
        raise QkvError(f"{folder} has no {TOKENIZER}; qkv needs the tokenizers-library file next to the weights")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception type on bad files
        raise QkvError(f"cannot read {path}: {error}") from None


def _is_gguf_request(path: Path, raw: str) -> bool:
    if raw.lower() in GGUF_NAMES and not path.exists():
        return True
    if path.suffix.lower() == ".gguf":
        return True
    return path.is_dir() and not (path / CONFIG).exists() and any(path.glob("*.gguf"))


def load_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[CausalDecoder, Tokenizer]:
    """(model in eval mode, tokenizers.Tokenizer) from a checkpoint folder or a GGUF file.

    A path ending in .gguf, a folder holding a .gguf and no config.json, or the name
    "smollm2" goes to qkv.models.gguf.load_gguf.
    """
    raw = os.fspath(path)
    folder = Path(raw).expanduser()
    if _is_gguf_request(folder, raw):
        try:
            from qkv.models.gguf import load_gguf
        except ImportError:
            raise QkvError(f"{raw}: GGUF support is not installed in this qkv (qkv.models.gguf is missing)") from None
        return load_gguf(raw, dtype)
    if not folder.exists():
        raise QkvError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise QkvError(f"{folder} is not a folder; give a checkpoint folder with {CONFIG}, {WEIGHTS}, {TOKENIZER}")
    if not (folder / CONFIG).is_file():
        raise QkvError(f"{folder} has no {CONFIG}; it is not a Hugging Face checkpoint folder")
    config = _read_json(folder / CONFIG)
    _family(config, str(folder))  # an unknown architecture is reported before reading weights
    tokenizer = read_tokenizer(folder)
    model = build_from_hf(config, read_weights(folder), dtype, source=str(folder))
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = _eos_ids(_read_json(generation).get("eos_token_id"), int(config["vocab_size"]))
        model.eos_token_ids = eos or model.eos_token_ids
    return model, tokenizer


def _hf_config_and_tensors(model: CausalDecoder) -> tuple[dict[str, Any], dict[str, Tensor]]:
    if isinstance(model, GPTModel):
        return model.cfg.to_hf_config(tie_word_embeddings=model.weights_tied), hf_keys.gpt2_to_hf(model)
    if isinstance(model, LlamaForCausalLM):
        return model.cfg.to_hf_config(), hf_keys.llama_to_hf(model)
    raise QkvError(f"save_pretrained saves GPTModel and LlamaForCausalLM, not {type(model).__name__}")


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a temporary file in the same folder, then rename over `path`."""
    atomic_write_with(path, lambda tmp: write(Path(tmp)))


def save_pretrained(model: CausalDecoder, tokenizer: Tokenizer, path: str | os.PathLike[str]) -> Path:
    """Write config.json, model.safetensors and tokenizer.json that transformers and
    load_pretrained both read. Each file is replaced atomically; config.json comes last."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise QkvError(f"{folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    config, tensors = _hf_config_and_tensors(model)
    param = next(model.parameters())
    config["dtype"] = str(param.dtype).removeprefix("torch.")
    if model.eos_token_ids:
        ids = list(model.eos_token_ids)
        config["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    _write_atomic(folder / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _write_atomic(folder / TOKENIZER, lambda p: tokenizer.save(str(p)))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _write_atomic(folder / CONFIG, lambda p: p.write_text(text, encoding="utf-8"))
    return folder
