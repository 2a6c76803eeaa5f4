"""What qkv's on-disk caches need to trust their own files: content digests, stale
temporary files of killed writers, an absolute cache folder, and one line when an entry is
thrown away.

A cache entry is tied to the bytes it was made from, never to file metadata: `content_digest`
reads every byte of the source files (SHA-256 of 8 MiB chunks, hashed in parallel threads,
the chunk digests then hashed in order with each file's size). A same-size replacement with
the modification time kept (`cp -p`, `rsync -a`, `tar`, `touch -r`) changes the bytes and so
the key; only a SHA-256 collision could fool it. Sampling blocks would be cheaper but a
swap that changes only the bytes between the samples (one tensor) would pass. What the full
read costs is in benchmarks/HISTORY.md ("Issue 28").

Writers name their temporary files `.<target>.<pid>.<hex>.tmp` (qkv.util.atomic); a writer killed
with SIGKILL leaves one behind, and `remove_stale_temporaries` deletes those whose process is
gone (or that are older than STALE_SECONDS, against pid reuse).

Shape legend: none (files and bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from qkv.errors import QkvError

CHUNK_BYTES = 8 << 20
STALE_SECONDS = 3600.0  # a temporary file this old is stale whatever its pid says
_TEMPORARY = re.compile(r"\..+\.([0-9]+)\.[0-9a-f]{8}\.tmp")
_MKSTEMP = re.compile(r"tmp[a-z0-9_]{8}\.(?:tmp|so)")  # what earlier versions wrote with tempfile.mkstemp


def _chunk_digest(fd: int, offset: int, size: int) -> bytes:
    digest = hashlib.sha256()
    done = 0
    while done < size:
        block = os.pread(fd, min(1 << 20, size - done), offset + done)
        if not block:
            raise OSError(f"the file ended {size - done:,} bytes early while hashing")
        digest.update(block)
        done += len(block)
    return digest.digest()


def content_digest(files: Iterable[Path], *, threads: int | None = None) -> str:
    """SHA-256 over the full content of `files`, in order (module docstring). OSError when
    one cannot be read."""
    total = hashlib.sha256()
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                offsets = range(0, size, CHUNK_BYTES)
                parts = pool.map(lambda o: _chunk_digest(fd, o, min(CHUNK_BYTES, size - o)), offsets)
                total.update(size.to_bytes(8, "little"))
                for part in parts:
                    total.update(part)
            finally:
                os.close(fd)
    return total.hexdigest()


def _tensor_digest(tensor: Tensor) -> bytes:
    tensor = tensor.detach().contiguous()
    digest = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
    if tensor.numel():
        digest.update(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
    return digest.digest()


def tensors_digest(state: Mapping[str, Tensor], *, threads: int | None = None) -> str:
    """SHA-256 over every tensor's name and the SHA-256 of its dtype, shape and bytes, in
    name order (the tensors hashed in parallel threads: hashlib lets go of the GIL)."""
    names = sorted(state)
    total = hashlib.sha256()
    with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        for name, part in zip(names, pool.map(lambda n: _tensor_digest(state[n]), names)):
            total.update(name.encode() + b"\0" + part)
    return total.hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temporaries(folder: Path) -> list[str]:
    """Delete temporary files in `folder` whose writer is gone (module docstring); their names."""
    removed: list[str] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry.name)
        if match is None and _MKSTEMP.fullmatch(entry.name) is None:
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_file() or entry.is_symlink():
            continue
        alive = _alive(int(match.group(1))) if match is not None else True  # no pid: by age only
        if alive and now - info.st_mtime < STALE_SECONDS:
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry.name)
    return removed


def absolute_folder(value: str, variable: str) -> Path:
    """`value` of the environment variable `variable` as an absolute path; a relative one is
    refused (the XDG spec says relative values are invalid: they would put what qkv loads
    under whatever folder it runs in)."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise QkvError(f"{variable} is the relative path {value!r}; set it to an absolute path (or unset it)")
    return path


def keeping_enabled() -> bool:
    """Whether qkv keeps what it prepares on disk (prepared weights, recovered merges):
    QKV_PREPARED_CACHE=0 (or false, no, off) turns it off."""
    return os.environ.get("QKV_PREPARED_CACHE", "").strip().lower() not in {"0", "false", "no", "off"}


def cache_folder() -> Path:
    """Where qkv keeps what it builds and remembers per machine (kernels, prepared weights,
    digests, recovered merges): $QKV_CACHE_DIR, else $XDG_CACHE_HOME/qkv, else ~/.cache/qkv;
    QkvError for a relative folder."""
    if os.environ.get("QKV_CACHE_DIR"):
        return absolute_folder(os.environ["QKV_CACHE_DIR"], "QKV_CACHE_DIR")
    if os.environ.get("XDG_CACHE_HOME"):
        return absolute_folder(os.environ["XDG_CACHE_HOME"], "XDG_CACHE_HOME") / "qkv"
    return absolute_folder(os.path.join(os.path.expanduser("~"), ".cache"), "HOME") / "qkv"


def say_discarded(what: Path, reason: str, then: str) -> None:
    """The one line said when a damaged cache entry is thrown away."""
    print(f"qkv: discarded {what} ({reason}); {then}", file=sys.stderr, flush=True)
