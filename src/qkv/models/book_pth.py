"""The book's saved GPT (`model.pth`, `model_and_optimizer.pth`, chapter 5.4) as a loader source.

The book saves `torch.save(model.state_dict(), "model.pth")` or a dict with
"model_state_dict" and "optimizer_state_dict". Those are pickles, so they are read only
with `torch.load(weights_only=True)` (no code runs, only tensors and plain containers are
rebuilt) and only after what can be checked without unpickling is checked: the file's
size, that it is torch's zip format, and the size of its pickle part. The tensors are
memory-mapped (`mmap=True`), so a large file costs no memory until the loader copies the
weights it checked, and an optimizer state in the file is never read. Every key is
accounted for against the book's GPTModel (unknown or missing: one line naming it).

The model's shape comes from the tensors (qkv.models.key_maps.book.infer_config: heads of 64
features, as every GPT-2 size in the book); the tokenizer is GPT-2's, as the book's
tiktoken `gpt2` encoding (qkv.models.hf.gpt2_tokenizer). The book's generate_text_simple
never stops at <|endoftext|>, so neither does a model loaded from its file.

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
from qkv.models.hf.untrusted import format_size

SUFFIXES = (".pth", ".pt")
MAX_FILE_BYTES = 64 * 2**30  # GPT-2 XL with its AdamW state is about 19 GB
MAX_PICKLE_BYTES = 64 * 2**20  # the pickle only names tensors: a few hundred KB for GPT-2 XL
MODEL_KEY = "model_state_dict"  # the book's model_and_optimizer.pth
KNOWN_KEYS = {MODEL_KEY, "optimizer_state_dict"}


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
            pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    except (OSError, zipfile.BadZipFile) as error:
        raise QkvError(f"cannot read {path}: {error}") from None
    if len(pickles) != 1:
        raise QkvError(f"{path} is a zip file but not one torch.save wrote (it has {len(pickles)} data.pkl entries)")
    if pickles[0].file_size > MAX_PICKLE_BYTES:
        raise QkvError(
            f"{path}: its pickle part is {format_size(pickles[0].file_size)}, more than a state dict needs "
            f"({format_size(MAX_PICKLE_BYTES)} at most); refusing to unpickle it"
        )


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The model's tensors of a book file (memory-mapped; the optimizer's part untouched)."""
    _check_container(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, KeyError, AttributeError) as error:
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise QkvError(f"{path} is not a state dict torch.load(weights_only=True) can read ({first})") from None
    if isinstance(loaded, dict) and MODEL_KEY in loaded:
        unknown = sorted(str(k)[:40] for k in loaded if k not in KNOWN_KEYS)
        if unknown:
            raise QkvError(f"{path}: unknown entry {unknown[0]!r} beside {MODEL_KEY} (the book saves {sorted(KNOWN_KEYS)})")
        loaded = loaded[MODEL_KEY]
    if not isinstance(loaded, dict) or not loaded:
        raise QkvError(f"{path} holds {type(loaded).__name__}, not a state dict (a dict of tensors)")
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise QkvError(f"{path}: entry {str(key)[:60]!r} is not a named tensor; it is not a state dict")
    return loaded


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
    state = read_state_dict(path)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    cfg = book_keys.infer_config(shapes, source=str(path))
    book_keys.check_book_state(shapes, cfg, source=str(path))
    odd = [k for k, v in state.items() if not v.is_floating_point()]
    if odd:
        raise QkvError(f"{path}: {odd[0]} holds {str(state[odd[0]].dtype).removeprefix('torch.')} values, not floating point")
    return BookFile(path, cfg, state, gpt2_tokenizer())


__all__ = ["BookFile", "is_book_file", "open_book_file", "read_state_dict"]
