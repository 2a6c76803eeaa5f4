"""Content digests remembered per file identity, so a warm start does not read a model again.

`content_digest` reads every byte (qkv.util.cache_integrity): about 0.6 s for SmolLM2's 94 MiB
and 4 s for a 1 GB file, on every load. `remembered_digest` keeps each digest beside the cache
under the file's identity: device, inode, size, modification time and change time (all in
nanoseconds). The change time (ctime) is the kernel's: any write to the file, `touch -r`,
`cp -p`, `rsync -a`, or a rename of another file into its place (a new inode) moves it, and no
system call sets it back, so a file whose identity is unchanged holds the bytes that were hashed.
A memo that cannot be read, or that is damaged, is ignored and written anew. `read_memo` and
`write_memo` are that for any memo of strings keyed by file identity (qkv.util.checked_memo's too).

Shape legend: none (files and bytes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from qkv.util.atomic import atomic_write_text
from qkv.util.cache_integrity import content_digest

MAX_ENTRIES = 64  # entries a memo keeps (the most recently made); a memo is a few kilobytes
MAX_MEMO_BYTES = 1 << 20  # a larger memo file is not read (it is not ours)


def file_identity(path: Path) -> str:
    """What changes whenever the file's bytes can have changed (module docstring)."""
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def read_memo(memo: Path, valid: Callable[[str], bool]) -> dict[str, str]:
    """A memo's entries (key -> value) whose values are `valid`; {} when it cannot be read, is
    damaged, or is larger than any memo qkv writes."""
    try:
        if memo.stat().st_size > MAX_MEMO_BYTES:
            return {}
        entries = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, str) and valid(v)}


def write_memo(memo: Path, entries: dict[str, str]) -> None:
    """The MAX_ENTRIES most recent `entries` written atomically; a read-only or full cache
    folder keeps nothing (what was remembered is still right, only not kept)."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo, json.dumps(dict(list(entries.items())[-MAX_ENTRIES:]), indent=0))
    except OSError:
        pass


def remembered_digest(files: Iterable[Path], memo: Path) -> str:
    """`content_digest(files)`, read from `memo` when every file's identity is the one it was
    hashed under, else computed and remembered. OSError when a file cannot be read."""
    paths = [Path(f) for f in files]
    key = "|".join(f"{p.resolve()}={file_identity(p)}" for p in paths)
    entries = read_memo(memo, lambda value: len(value) == 64)
    if key in entries:
        return entries[key]
    digest = content_digest(paths)
    entries[key] = digest
    write_memo(memo, entries)
    return digest
