"""The book's saved GPT (`model.pth`, `model_and_optimizer.pth`, chapter 5.4) as a loader source.

The book saves `torch.save(model.state_dict(), "model.pth")` or a dict with
"model_state_dict" and "optimizer_state_dict". Those are pickles, so they are read only
with `torch.load(weights_only=True)` (no code runs, only tensors and plain containers are
rebuilt) and only after what can be checked without unpickling is checked: the file's
size, that it is torch's zip format, and the size of its pickle part. The tensors are
memory-mapped (`mmap=True`), so a large file costs no memory until the loader copies the
weights it checked, and an optimizer state's tensors are never read. Its pickled structure
is: torch's zip holds the whole dict as one pickle and torch.load has no way to rebuild part
of it, so that pickle is bounded instead, by what a state dict of its tensors takes
(`PICKLE_BYTES_PER_TENSOR` for each tensor stored in the archive, about 100 bytes in the book's
files with and without AdamW's state) and by `MAX_PICKLE_BYTES` in all: a 5.3 MB optimizer
pickle beside 2,033 tensors took 1.8 s and 69 MB to unpickle (a 54 MB one 8 to 16 s and 286 MB)
and is refused in 0.2 s, unread. Every key is accounted for against
the book's GPTModel (unknown or missing: one line naming it).

The model's shape comes from the tensors but for its head count, which a state dict cannot
say (qkv.models.key_maps.book.infer_config): it is read from the book's config dict
(GPT_CONFIG_124M's keys) saved in the file beside model_state_dict, or from a `config.json`
of those keys beside the file; without either only GPT-2's four widths (heads of 64
features) load, any other is refused by name, never guessed. The tokenizer is GPT-2's, as the
book's tiktoken `gpt2` encoding (qkv.models.hf.gpt2_tokenizer). The book's
generate_text_simple never stops at <|endoftext|>, so neither does a model loaded from its file.

Shape legend: C embedding, V vocabulary, P context length.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.key_maps import book as book_keys
from qkv.models.key_maps import hf as hf_keys
from qkv.models.configs.gpt2 import GPTConfig
from qkv.models.hf.gpt2_tokenizer import gpt2_tokenizer
from qkv.models.hf.untrusted import format_size, read_json

SUFFIXES = (".pth", ".pt")
MAX_FILE_BYTES = 64 * 2**30  # GPT-2 XL with its AdamW state is about 19 GB
# The pickle only names tensors, about 100 bytes each: 250 KB for GPT-2 XL with AdamW's state,
# 6.4 MB for the deepest GPTModel qkv builds (1,024 layers) with it. Unpickling (torch's
# weights_only unpickler is Python) ran at about 6 MB/s and 5 bytes of memory a byte.
MAX_PICKLE_BYTES = 8 * 2**20
PICKLE_BYTES_PER_TENSOR = 1024  # ten times what the book's files take for each tensor they store
PICKLE_SLACK_BYTES = 64 * 2**10  # the dicts around them, an optimizer's param_groups, a config
MODEL_KEY = "model_state_dict"  # the book's model_and_optimizer.pth
KNOWN_KEYS = {MODEL_KEY, "optimizer_state_dict"}
CONFIG_FILE = "config.json"  # the book's GPT config dict saved beside the file (json.dump(GPT_CONFIG, ...))
MAX_CONFIG_BYTES = 2**20
SHAPE_KEYS = ("vocab_size", "context_length", "emb_dim", "n_layers", "qkv_bias")  # what the tensors also say
HOW_TO_SAY_HEADS = (
    "save the book's config dict beside it, json.dump(GPT_CONFIG, open('config.json', 'w')), or in it, "
    "torch.save({'model_state_dict': model.state_dict(), 'config': GPT_CONFIG}, path)"
)


def is_book_file(path: Path) -> bool:
    """A file named .pth/.pt, or any file in torch's zip format (torch.save since 1.6)."""
    return path.is_file() and (path.suffix.lower() in SUFFIXES or zipfile.is_zipfile(path))


def _check_container(path: Path) -> None:
    """Size and layout, before anything is unpickled."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise QkvError(f"{path} is {format_size(size)}; qkv reads book checkpoints of at most {format_size(MAX_FILE_BYTES)}")
    if not zipfile.is_zipfile(path):
        raise QkvError(
            f"{path} is not in torch.save's zip format (an old or foreign pickle); qkv reads only "
            "torch.save(model.state_dict(), 'model.pth') files of PyTorch 1.6 and later"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (OSError, zipfile.BadZipFile) as error:
        raise QkvError(f"cannot read {path}: {error}") from None
    pickles = [i for i in entries if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pickles) != 1:
        raise QkvError(f"{path} is a zip file but not one torch.save wrote (it has {len(pickles)} data.pkl entries)")
    size = pickles[0].file_size
    if size > MAX_PICKLE_BYTES:
        raise QkvError(
            f"{path}: its pickle part is {format_size(size)}, more than a state dict needs "
            f"({format_size(MAX_PICKLE_BYTES)} at most); refusing to unpickle it"
        )
    tensors = sum(1 for i in entries if "/data/" in i.filename)  # torch.save stores each storage as archive/data/N
    bound = PICKLE_SLACK_BYTES + PICKLE_BYTES_PER_TENSOR * tensors
    if size > bound:
        raise QkvError(
            f"{path}: its pickle part is {format_size(size)} for {tensors} stored tensors, more than their state "
            f"dicts need ({format_size(bound)} at most: an optimizer state or other entry holds large Python data); "
            "refusing to unpickle it"
        )


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The model's tensors of a book file (memory-mapped; the optimizer's tensors untouched)."""
    return _read_saved(path)[0]


def _is_config(value: Any) -> bool:
    return isinstance(value, dict) and "n_heads" in value and all(isinstance(k, str) for k in value)


def _read_saved(path: Path) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """(the model's tensors, the book's config dict saved beside them in the file, if any)."""
    _check_container(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, KeyError, AttributeError) as error:
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise QkvError(f"{path} is not a state dict torch.load(weights_only=True) can read ({first})") from None
    saved_config = None
    if isinstance(loaded, dict) and MODEL_KEY in loaded:
        configs = [k for k, v in loaded.items() if k not in KNOWN_KEYS and _is_config(v)]
        if len(configs) > 1:
            raise QkvError(f"{path}: two GPT config dicts ({configs[0]!r} and {configs[1]!r}) beside {MODEL_KEY}")
        unknown = sorted(str(k)[:40] for k in loaded if k not in KNOWN_KEYS and k not in configs)
        if unknown:
            raise QkvError(f"{path}: unknown entry {unknown[0]!r} beside {MODEL_KEY} (the book saves {sorted(KNOWN_KEYS)}, "
                           "and qkv reads a config dict with n_heads)")
        saved_config = loaded[configs[0]] if configs else None
        loaded = loaded[MODEL_KEY]
    if not isinstance(loaded, dict) or not loaded:
        raise QkvError(f"{path} holds {type(loaded).__name__}, not a state dict (a dict of tensors)")
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise QkvError(f"{path}: entry {str(key)[:60]!r} is not a named tensor; it is not a state dict")
    return loaded, saved_config


def _config_beside(path: Path) -> dict[str, Any] | None:
    """The book's config dict in a config.json beside the file, None without one (or when that
    config.json is another kind, e.g. a Hugging Face folder's, which has no n_heads)."""
    beside = path.parent / CONFIG_FILE
    if not beside.is_file():
        return None
    config = read_json(beside, max_bytes=MAX_CONFIG_BYTES)
    return config if _is_config(config) else None


def _heads(path: Path, shapes: dict[str, tuple[int, ...]], saved: dict[str, Any] | None) -> tuple[int | None, str]:
    """The head count the file's config says (in the file, else beside it), with where it was
    read, each config checked against what the tensors say; (None, "") when none says it."""
    found = [(config, where) for config, where in ((saved, f"{path}'s config"), (_config_beside(path), str(path.parent / CONFIG_FILE)))
             if config is not None]
    if not found:
        return None, ""
    if len(found) == 2 and found[0][0]["n_heads"] != found[1][0]["n_heads"]:
        raise QkvError(f"{path}: its saved config says n_heads {str(found[0][0]['n_heads'])[:20]}, "
                       f"{found[1][1]} says {str(found[1][0]['n_heads'])[:20]}; remove the wrong one")
    config, where = found[0]
    heads = config["n_heads"]
    cfg = book_keys.infer_config(shapes, source=where, n_heads=heads)
    for key in SHAPE_KEYS:
        if key in config and config[key] != getattr(cfg, key):
            raise QkvError(f"{where}: {key} is {str(config[key])[:40]}, but the tensors of {path.name} say {getattr(cfg, key)}")
    return heads, where


@dataclass
class BookFile:
    """A checked book checkpoint, seen through Hugging Face GPT-2 names (what the loader plans with)."""

    path: Path
    cfg: GPTConfig
    state: dict[str, Tensor]  # the book's names, memory-mapped
    tokenizer: Tokenizer
    config: dict[str, Any] = field(init=False)
    stored_in_four_bits: bool = False
    prefers_float32: bool = True  # the book's own greedy text is the reference: no quantizing by default

    def __post_init__(self) -> None:
        self.config = self.cfg.to_hf_config(tie_word_embeddings=False)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {m.hf_name: m.shape for m in hf_keys.gpt2_key_maps(self.cfg, tied=False)}

    @property
    def read_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def read_tensors(self, dtype: torch.dtype) -> dict[str, Tensor]:
        qkv_state = book_keys.book_to_qkv_state(self.state, self.cfg, source=str(self.path))
        tensors = hf_keys.gpt2_state_to_hf(qkv_state, self.cfg, tied=False)
        return {k: v.contiguous().clone() for k, v in tensors.items()}  # out of the file's mapping

    def chat_template(self) -> None:
        return None


def open_book_file(path: Path) -> BookFile:
    """Read and check a book checkpoint's keys and shapes; its weights are not copied yet."""
    state, saved_config = _read_saved(path)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    heads, _ = _heads(path, shapes, saved_config)
    cfg = book_keys.infer_config(shapes, source=str(path), n_heads=heads, how_to_say_heads=HOW_TO_SAY_HEADS)
    book_keys.check_book_state(shapes, cfg, source=str(path))
    odd = [k for k, v in state.items() if not v.is_floating_point()]
    if odd:
        raise QkvError(f"{path}: {odd[0]} holds {str(state[odd[0]].dtype).removeprefix('torch.')} values, not floating point")
    return BookFile(path, cfg, state, gpt2_tokenizer())


__all__ = ["BookFile", "is_book_file", "open_book_file", "read_state_dict"]
