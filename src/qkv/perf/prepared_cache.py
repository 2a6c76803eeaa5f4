"""Prepared weights kept on disk, so that the next load of a model skips decoding and quantizing.

Loading SmolLM2 for `qkv generate` decodes its GGUF blocks to float32 (0.6-0.9 s here),
stacks the projections and quantizes them again (1.1-1.4 s), all to arrive at the same
tensors every time. The first `load_for_generation` of a model at a precision writes the
prepared model's state to `<cache>/prepared/<key>.safetensors` (`<cache>` as for qkv's
kernels: $QKV_CACHE_DIR, else $XDG_CACHE_HOME/qkv, else ~/.cache/qkv); the next ones build
the model's skeleton (no weights), make the same prepared layers empty and assign the
file's tensors, read with safetensors (never pickle).

The key hashes what the prepared tensors depend on: the weight files (resolved path, size,
modification time), the precision, torch's version and the source of the qkv modules that
load and prepare weights, so a changed file, a new torch or a changed qkv writes a new
entry. Only quantized precisions on qkv's kernels are kept (float32 and bfloat16 prepare in
a moment), only for sources of at least SMALLEST_SOURCE bytes, and only the KEEP most
recently used files. A file that cannot be read or does not fit the model is deleted and
the model is prepared from its source again. QKV_PREPARED_CACHE=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.native.build import cache_folder

SMALLEST_SOURCE = 32 << 20  # bytes of weight files below which preparing is quick: not kept
KEEP = 4  # prepared models kept (the most recently used)
_OFF = {"0", "false", "no", "off"}
_PACKAGE = Path(__file__).resolve().parents[1]  # src/qkv
# the modules whose code decides the prepared tensors (their source is part of the key)
_CODE = ("fusion.py", "precision.py", "native/ops.py", "perf/quantize.py", "perf/prepare.py", "perf/prepared_cache.py",
         "models", "attention/grouped_query.py")


def enabled() -> bool:
    return os.environ.get("QKV_PREPARED_CACHE", "").strip().lower() not in _OFF


@functools.lru_cache(maxsize=1)
def _code_digest() -> bytes:
    """The source of the modules in _CODE, hashed once per process (it does not change under it)."""
    digest = hashlib.sha256()
    for name in _CODE:
        path = _PACKAGE / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.digest()


def prepared_path(files: list[Path], precision: str) -> Path | None:
    """Where the model prepared from `files` at `precision` is kept, or None when it is
    not kept (module docstring)."""
    if not enabled():
        return None
    try:
        stats = [(str(f.resolve()), f.stat()) for f in files]
    except OSError:
        return None
    if sum(s.st_size for _, s in stats) < SMALLEST_SOURCE:
        return None
    digest = hashlib.sha256(_code_digest())
    for part in (precision, torch.__version__, *(f"{name}|{s.st_size}|{s.st_mtime_ns}" for name, s in stats)):
        digest.update(part.encode())
        digest.update(b"\0")
    return cache_folder() / "prepared" / f"{digest.hexdigest()[:24]}.safetensors"


def read_prepared(path: Path) -> dict[str, Tensor] | None:
    """The kept tensors, or None (a missing file; an unreadable one is deleted)."""
    if not path.is_file():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError):
        discard(path)
        return None
    try:
        os.utime(path)  # most recently used: kept longest
    except OSError:
        pass
    return state


def discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def keep_prepared(model: nn.Module, path: Path) -> bool:
    """Write `model`'s state to `path` atomically and drop all but the KEEP newest files;
    False when the folder is not writable (the model is simply not kept)."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        os.close(handle)
        try:
            save_file(state, temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except Exception:  # noqa: BLE001 - a full disk, a read-only folder: the model is just not kept
        return False
    kept = sorted(path.parent.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in kept[KEEP:]:
        discard(old)
    return True
