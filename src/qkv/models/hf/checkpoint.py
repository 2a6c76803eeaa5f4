"""Hugging Face checkpoint folders in and out: config.json + safetensors + tokenizer.json.

    open_folder(path) -> FolderCheckpoint              config, tensor headers, tokenizer (no weights yet)
    plan_model(config, shapes, ...) -> ModelPlan        validated config, memory and shapes checked
    build_from_hf(config, tensors, dtype) -> model      config.json dict + HF-named tensors
    save_pretrained(model, tokenizer, path)             the same folder format, atomically

`qkv.models.loader` is the one loader that puts these together (and GGUF files).
A folder comes from anywhere, so nothing is allocated before it is checked: config.json
is validated field by field, the memory the model needs is estimated from it, every tensor
named and shaped in the safetensors headers is checked against the model the config
describes, and only then are weights read and the model built. Files named by the sharded
index must lie inside the folder. Weights are read only with safetensors, never pickle;
every problem a user can fix raises a QkvError that names it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor

from qkv.util.atomic import atomic_write_with
from qkv.errors import QkvError
from qkv.models.key_maps import hf as hf_keys
from qkv.models.decoder import CausalDecoder
from qkv.util.empty_init import meta_names, parameters_on_meta
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.models.registry import FAMILIES, Family, family_of
from qkv.models.hf.tokenizer_guard import guard
from qkv.models.hf.untrusted import format_size, inside, read_json_object, require_memory

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
# Every file the loader reads from a folder: a folder that holds any of them is a model folder.
FOLDER_FILES = (CONFIG, WEIGHTS, INDEX, TOKENIZER, TOKENIZER_CONFIG, CHAT_TEMPLATE, GENERATION_CONFIG)
MAX_TOKENIZER_BYTES = 512 * 2**20
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
MODULE_OVERHEAD = 8 * 2**10  # Python objects of one module, beyond its tensors

Shapes = Mapping[str, tuple[int, ...]]


def config_value(config: dict[str, Any], key: str) -> Any:
    """A top-level config.json value, else its text_config's (a multimodal config, Gemma 3)."""
    if key in config:
        return config[key]
    text = config.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def eos_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    """config.json's eos_token_id (int, list or null) as a tuple of ids inside the vocabulary."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size)


# ----------------------------------------------------------------------------- plan, then build


@dataclass
class ModelPlan:
    """A config that passed every check that needs no weights: what `build` will make."""

    family: Family
    spec: Any
    config: dict[str, Any]
    vocab_size: int
    parameters: int
    dtype: torch.dtype
    source: str

    def check_vocabulary(self, tokenizer: Tokenizer, what: str) -> None:
        """The tokenizer may not make ids the model has no embedding for."""
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size > self.vocab_size:
            raise QkvError(
                f"{what} has {size:,} tokens but the model's vocabulary has {self.vocab_size:,}; "
                "the tokenizer does not belong to this model"
            )

    def skeleton(self) -> CausalDecoder:
        """The model in eval mode with its parameters on the meta device (shapes only)."""
        with parameters_on_meta():
            model = self.family.build(self.spec)
        model.to(self.dtype)  # buffers (RoPE frequencies) as built; parameters are shapes only
        model.eos_token_ids = eos_ids(config_value(self.config, "eos_token_id"), self.vocab_size)
        return model.eval()

    def build(self, tensors: dict[str, Tensor], *, owned: bool = False) -> CausalDecoder:
        """The model in eval mode with `tensors` (HF names) loaded; each one checked first.

        The model is made with its parameters on the meta device (no random init to
        overwrite: qkv.util.empty_init) and the weights are assigned. owned=True: the
        caller hands the tensors over (nothing else holds them), so those already in the
        model's dtype become its parameters without a copy; else each one is copied.
        """
        check_tensors(tensors, self.source)
        with parameters_on_meta():
            model = self.family.build(self.spec)
        model.to(self.dtype)  # buffers (RoPE frequencies) as before; parameters are shapes only
        rename = self.family.rename(tensors)
        tensors = {rename(k): v for k, v in tensors.items()}
        maps, skip, tied = self.family.mapping(self.spec)
        hf_keys.load_mapped(model, maps, tensors, skip=skip, tied_duplicates=tied, source=self.source, copy=not owned)
        unloaded = meta_names(model)
        if unloaded:  # strict loading fills every entry; this guards the model classes
            raise QkvError(f"{self.source}: the model has no weights for {hf_keys.names_preview(unloaded)}")
        model.eos_token_ids = eos_ids(config_value(self.config, "eos_token_id"), self.vocab_size)
        return model.eval()


def plan_model(
    config: dict[str, Any], shapes: Shapes, *, dtype: torch.dtype = torch.float32, source: str,
    read_bytes: int = 0, max_memory: int | None = None, weight_bytes: int | None = None,
) -> ModelPlan:
    """Validate config.json, estimate memory, and check every tensor's name and shape.

    `shapes` are the checkpoint's tensor shapes under Hugging Face names, as the file's
    header states them; `read_bytes` is what reading the tensors will hold in memory;
    `weight_bytes`, where given, what the model's weights take as loaded (a GGUF file's
    blocks kept as stored) instead of every parameter in `dtype` and a prepared copy.
    Nothing the size of the model is allocated: names and shapes come from the config.
    """
    family = family_of(config, source)
    try:
        spec = family.parse(config)
    except QkvError:
        raise
    except (ValueError, TypeError) as error:
        raise QkvError(f"{source}: config.json is not usable: {error}") from None
    rename = family.rename(shapes)
    maps, skip, tied = family.mapping(spec)
    hf_keys.check_names_and_shapes(
        maps, {rename(k): v for k, v in shapes.items()}, skip=skip, tied_duplicates=tied, source=source
    )
    parameters = sum(math.prod(m.shape) for m in maps)
    weights = parameters * (4 + torch.finfo(dtype).bits // 8) if weight_bytes is None else weight_bytes
    needed = weights + read_bytes + len(maps) * MODULE_OVERHEAD
    require_memory(needed, max_memory=max_memory, what=f"{source} ({parameters:,} parameters)")
    return ModelPlan(family, spec, config, config_value(config, "vocab_size"), parameters, dtype, source)


def check_tensors(tensors: Mapping[str, Tensor], source: str) -> None:
    """Weights must be floating point and finite (no NaN or infinity).

    Finite means the smallest and largest values are (`aminmax` propagates NaN): a
    reduction that reads the weights once, where `isfinite(t).all()` also wrote a bool per
    weight (40 ms against 550-670 ms for SmolLM2's 134M weights on a 2-core CPU). Tensors
    that together are exactly one tensor's memory (the GGUF reader's views into one decoded
    tensor per type) are checked in one pass over it: one operation instead of one per
    weight, which mattered on a loaded machine, where each multi-threaded operation could
    wait milliseconds for its second thread. Only when that pass finds a bad value is each
    one checked, to name it.
    """
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise QkvError(f"{source}: weight {name} holds {str(tensor.dtype).removeprefix('torch.')} values; weights must be floating point")
    for group in _tilings(tensors):
        if len(group) > 1 and _finite(_whole(tensors[group[0]])):
            continue
        for name in group:
            if not _finite(tensors[name]):
                raise QkvError(f"{source}: weight {name} holds NaN or infinite values; the checkpoint is corrupt")


def _finite(tensor: Tensor) -> bool:
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _tilings(tensors: Mapping[str, Tensor]) -> list[list[str]]:
    """Names grouped so that each group of several is contiguous tensors, one per stretch,
    that cover their shared memory from end to end; every other name is a group of one."""
    by_storage: dict[tuple[int, torch.dtype], list[str]] = {}
    for name, tensor in tensors.items():
        if tensor.is_contiguous() and tensor.device.type == "cpu":
            by_storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.dtype), []).append(name)
    groups: list[list[str]] = []
    grouped: set[str] = set()
    for names in by_storage.values():
        names = sorted(names, key=lambda n: tensors[n].storage_offset())
        end = 0
        for name in names:
            tensor = tensors[name]
            if tensor.storage_offset() != end:
                break
            end += tensor.numel()
        else:
            first = tensors[names[0]]
            if len(names) > 1 and end * first.element_size() == first.untyped_storage().nbytes():
                groups.append(names)
                grouped.update(names)
    return groups + [[name] for name in tensors if name not in grouped]


def _whole(tensor: Tensor) -> Tensor:
    """All of the memory under `tensor`, as a flat tensor of its dtype."""
    storage = tensor.untyped_storage()
    return tensor.new_empty(0).set_(storage, 0, (storage.nbytes() // tensor.element_size(),))


def build_from_hf(
    config: dict[str, Any], state_dict: dict[str, Tensor], dtype: torch.dtype = torch.float32,
    *, source: str = "checkpoint", max_memory: int | None = None,
) -> CausalDecoder:
    """A qkv model in eval mode from a Hugging Face config.json dict and HF-named tensors."""
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    plan = plan_model(config, shapes, dtype=dtype, source=source, max_memory=max_memory)
    return plan.build(state_dict)


# ----------------------------------------------------------------------------- reading a folder


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I64, ...

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * FLOAT_DTYPES.get(self.dtype, 8)


def _weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """{file: the names the index places there, or None for every tensor in it}."""
    single, index = folder / WEIGHTS, folder / INDEX
    if single.exists():
        return {single: None}
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QkvError(f"{index} has no weight_map")
        by_file: dict[Path, list[str]] = {}
        for name, entry in weight_map.items():
            file = inside(folder, entry, what=f"{INDEX} entry {name[:80]!r}")
            by_file.setdefault(file, []).append(name)
        return dict(by_file)
    pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = f" (found {', '.join(pickled[:5])}: qkv never loads pickle files; convert to safetensors)" if pickled else ""
    raise QkvError(f"{folder} has neither {WEIGHTS} nor {INDEX}{hint}")


def _corrupt(path: Path, error: BaseException) -> QkvError:
    reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    return QkvError(f"{path} is truncated or corrupt ({reason}); save or copy it again")


def read_headers(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor's file, shape and dtype from the safetensors headers (no data is read)."""
    entries: dict[str, TensorEntry] = {}
    for path, names in _weight_files(folder).items():
        if not path.is_file():
            raise QkvError(f"weights file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as handle:
                present = set(handle.keys())
                wanted = sorted(present) if names is None else names
                absent = [k for k in wanted if k not in present]
                if absent:
                    raise QkvError(f"{path} lacks {hf_keys.names_preview(absent)}, which {INDEX} places there")
                for name in wanted:
                    view = handle.get_slice(name)
                    entries[name] = TensorEntry(path, tuple(view.get_shape()), view.get_dtype())
        except QkvError:
            raise
        except Exception as error:  # safetensors reports truncation/corruption with its own types
            raise _corrupt(path, error) from None
    odd = [k for k, e in entries.items() if e.dtype not in FLOAT_DTYPES]
    if odd:
        raise QkvError(f"{folder}: weight {odd[0]} is stored as {entries[odd[0]].dtype}; weights must be floating point")
    return entries


def read_tensors(entries: Mapping[str, TensorEntry]) -> dict[str, Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry.file, []).append(name)
    tensors: dict[str, Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in names:
                    tensors[name] = handle.get_tensor(name)
        except Exception as error:
            raise _corrupt(path, error) from None
    return tensors


def read_weights(folder: Path) -> dict[str, Tensor]:
    """All tensors of a folder: model.safetensors, or the shards its index lists."""
    return read_tensors(read_headers(folder))


def read_tokenizer(folder: Path) -> Tokenizer:
    path = folder / TOKENIZER
    if not path.is_file():
        raise QkvError(f"{folder} has no {TOKENIZER}; qkv needs the tokenizers-library file next to the weights")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise QkvError(f"{path} is {format_size(path.stat().st_size)}; qkv reads tokenizers up to {format_size(MAX_TOKENIZER_BYTES)}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception type on bad files
        raise QkvError(f"cannot read {path}: {str(error)[:200]}") from None
    except BaseException as error:  # a pyo3 panic while reading
        if type(error).__name__ != "PanicException":
            raise
        raise QkvError(f"cannot read {path}: the tokenizers library failed on it ({str(error)[:120]})") from None
    return guard(tokenizer, str(path))


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplateSource:
    source: str
    bos_token: str | None
    eos_token: str | None


def read_chat_template(folder: Path) -> ChatTemplateSource | None:
    """tokenizer_config.json's chat_template (or chat_template.jinja), None when there is none."""
    config_path = folder / TOKENIZER_CONFIG
    config = read_json_object(config_path) if config_path.exists() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: take the default one
        named = [t for t in source if isinstance(t, dict) and isinstance(t.get("template"), str)]
        if len(named) != len(source):
            raise QkvError(f"{config_path}: chat_template must be a string or a list of {{name, template}} objects")
        source = next((t["template"] for t in named if t.get("name") == "default"), None)
    elif source is not None and not isinstance(source, str):
        raise QkvError(f"{config_path}: chat_template must be a string, got {type(source).__name__}")
    jinja_file = folder / CHAT_TEMPLATE
    if source is None and jinja_file.is_file():
        try:
            source = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise QkvError(f"cannot read {jinja_file}: {error}") from None
    if source is None:
        return None
    return ChatTemplateSource(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


@dataclass
class FolderCheckpoint:
    """What a checkpoint folder holds, checked but with no weight read yet."""

    path: Path
    config: dict[str, Any]
    entries: dict[str, TensorEntry]
    tokenizer: Tokenizer

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: e.shape for k, e in self.entries.items()}

    @property
    def read_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read_tensors(self, dtype: torch.dtype) -> dict[str, Tensor]:
        return read_tensors(self.entries)

    def generation_eos(self) -> tuple[int, ...]:
        path = self.path / GENERATION_CONFIG
        if not path.is_file():
            return ()
        return eos_ids(read_json_object(path).get("eos_token_id"), config_value(self.config, "vocab_size"))

    def chat_template(self) -> ChatTemplateSource | None:
        return read_chat_template(self.path)


def open_folder(folder: Path) -> FolderCheckpoint:
    if not folder.exists():
        raise QkvError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise QkvError(f"{folder} is not a folder; give a checkpoint folder with {CONFIG}, {WEIGHTS}, {TOKENIZER}")
    if not (folder / CONFIG).is_file():
        raise QkvError(f"{folder} has no {CONFIG}; it is not a Hugging Face checkpoint folder")
    config = read_json_object(folder / CONFIG)
    family_of(config, str(folder))  # an unknown architecture is reported before reading anything else
    tokenizer = read_tokenizer(folder)
    return FolderCheckpoint(folder, config, read_headers(folder), tokenizer)


def _hf_config_and_tensors(model: CausalDecoder) -> tuple[dict[str, Any], dict[str, Tensor]]:
    if isinstance(model, GPT2Decoder):
        return model.cfg.to_hf_config(tie_word_embeddings=model.weights_tied), hf_keys.gpt2_to_hf(model)
    if isinstance(model, LlamaForCausalLM):
        return model.cfg.to_hf_config(), hf_keys.llama_to_hf(model)
    raise QkvError(f"save_pretrained saves GPT2Decoder and LlamaForCausalLM, not {type(model).__name__}")


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
