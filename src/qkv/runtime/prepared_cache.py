"""Prepared weights kept on disk, so that the next load of a model skips decoding and quantizing.

Loading SmolLM2 for `qkv generate` decodes its GGUF blocks to float32 (0.6-0.9 s here),
stacks the projections and quantizes them again (1.1-1.4 s), all to arrive at the same
tensors every time. The first `load_for_generation` of a model at a precision writes the
prepared model's state to `<cache>/prepared/<key>.safetensors` (`<cache>` as for qkv's
kernels: $QKV_CACHE_DIR, else $XDG_CACHE_HOME/qkv, else ~/.cache/qkv); the next ones build
the model's skeleton (no weights), make the same prepared layers empty and assign the
file's tensors, read with safetensors (never pickle).

The key hashes what the prepared tensors depend on: the full content of the weight files
(qkv.util.cache_integrity.content_digest: every byte, so a same-size file swapped in with its
modification time kept gets a new key; qkv.util.digest_memo remembers it under the file's
identity, inode to change time, which any write moves, so a warm start reads no byte of it
again), the precision, torch's version and the source of
the qkv modules that load and prepare weights, so a changed file, a new torch or a changed
qkv writes a new entry. Only quantized precisions on qkv's kernels are kept (float32 and
bfloat16 prepare in a moment), only for sources of at least SMALLEST_SOURCE bytes, and only
the KEEP most recently used files (QKV_PREPARED_MIN_BYTES=N keeps sources of N bytes or more).

Every entry is verified when it is read: the SHA-256 of its tensors (names, dtypes, shapes,
bytes) against the one written in its metadata, then (`check_entry`) every name, dtype and
shape against the model it is assigned to, and every floating tensor finite. An entry that
fails is deleted, one line on stderr says why, and the model is prepared from its source
again (and kept anew). Temporary files of writers that were killed are removed when the
folder is next used. QKV_PREPARED_CACHE=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.util.atomic import atomic_write_with
from qkv.util.cache_integrity import cache_folder, keeping_enabled, remove_stale_temporaries, say_discarded, tensors_digest
from qkv.util.digest_memo import remembered_digest

SMALLEST_SOURCE = 32 << 20  # bytes of weight files below which preparing is quick: not kept
KEEP = 4  # prepared models kept (the most recently used)
DIGEST_KEY = "qkv_tensors_sha256"  # the entry's own checksum, in its safetensors metadata
_PACKAGE = Path(__file__).resolve().parents[1]  # src/qkv
# the modules whose code decides the prepared tensors (their source is part of the key)
_CODE = ("attention/stacking.py", "names.py", "runtime/native/ops.py", "runtime/linear/quantized.py",
         "runtime/prepare.py", "runtime/prepared_cache.py", "models", "attention/grouped_query.py")


def smallest_source() -> int:
    """SMALLEST_SOURCE, or $QKV_PREPARED_MIN_BYTES when it is a whole number of bytes."""
    value = os.environ.get("QKV_PREPARED_MIN_BYTES", "").strip()
    return int(value) if value.isdigit() else SMALLEST_SOURCE



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
    if not keeping_enabled():
        return None
    try:
        if sum(f.stat().st_size for f in files) < smallest_source():
            return None
        content = remembered_digest(files, cache_folder() / "digests.json")  # read once per file version
    except OSError:
        return None
    digest = hashlib.sha256(_code_digest())
    for part in (precision, torch.__version__, content):
        digest.update(part.encode())
        digest.update(b"\0")
    return cache_folder() / "prepared" / f"{digest.hexdigest()[:24]}.safetensors"


def read_prepared(path: Path) -> dict[str, Tensor] | None:
    """The kept tensors, or None: a missing file, or a damaged one (deleted, one line said)."""
    remove_stale_temporaries(path.parent)
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            expected = (handle.metadata() or {}).get(DIGEST_KEY)
            state = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        reject(path, f"it cannot be read: {str(error).splitlines()[0][:120] if str(error) else type(error).__name__}")
        return None
    if expected is None or tensors_digest(state) != expected:
        reject(path, "its checksum does not match its tensors" if expected else "it has no checksum")
        return None
    try:
        os.utime(path)  # most recently used: kept longest
    except OSError:
        pass
    return state


def check_entry(state: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> str | None:
    """Why `state` cannot be assigned to a model whose state is `expected` (names, dtypes,
    shapes, finite floats), or None when it can."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        return f"its tensors differ from the model's ({len(missing)} missing, {len(extra)} unknown)"
    for name, want in expected.items():
        got = state[name]
        if got.dtype != want.dtype:
            return f"{name} is {got.dtype}, the model needs {want.dtype}"
        if tuple(got.shape) != tuple(want.shape):
            return f"{name} has shape {tuple(got.shape)}, the model needs {tuple(want.shape)}"
        # one reduction instead of a mask as large as the tensor: a NaN or infinity anywhere
        # (or values near float32's limit, like 1e38 scales) makes the sum non-finite
        if got.is_floating_point() and got.numel() and not bool(torch.isfinite(got.sum(dtype=torch.float32))):
            return f"{name} holds NaN, infinite or overflowing values"
    return None


def reject(path: Path, reason: str) -> None:
    """Delete a damaged entry and say so in one line."""
    discard(path)
    say_discarded(path, reason, "preparing the weights from their source again")


def discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def keep_prepared(model: nn.Module, path: Path) -> bool:
    """Write `model`'s state to `path` atomically, with its checksum, and drop all but the
    KEEP newest files; False when the folder is not writable (the model is simply not kept)."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}
    metadata = {DIGEST_KEY: tensors_digest(state)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        atomic_write_with(path, lambda temporary: save_file(state, temporary, metadata=metadata))
    except Exception:  # noqa: BLE001 - a full disk, a read-only folder: the model is just not kept
        return False
    kept = sorted(path.parent.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in kept[KEEP:]:
        discard(old)
    return True
