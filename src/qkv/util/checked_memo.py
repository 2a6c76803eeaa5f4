"""Checks a file passed, remembered per file identity, so a warm start does not read it again to check it.

Some checks read every byte of a model file (qkv.models.gguf.scales: every block scale
finite, 0.1-0.3 s for a 1B file on each load, most of it page faults). Such a check passes or
fails the same way as long as the bytes and the checking code are the same. The bytes are
the same while the file's identity is (qkv.util.digest_memo.file_identity: device, inode,
size, modification and change times); the code is the same while its module's source is.
`check_once` runs the check unless `<cache>/checked.json` says it passed on both; only passes
are kept, so a file that fails is checked, and refused, every time. A file modified less than
SETTLE seconds ago is not remembered: the kernel stamps times from a clock that advances in
ticks of milliseconds, so a file rewritten within the same tick with the same size could keep
its identity (git's "racy" files, handled the same way). A memo that cannot be read
or is damaged is ignored and written anew; QKV_PREPARED_CACHE=0 keeps nothing, as it does for
prepared weights and digests' neighbours.

Shape legend: none (files and bytes).
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.util.cache_integrity import cache_folder, keeping_enabled
from qkv.util.digest_memo import file_identity, read_memo, write_memo

PASSED = "passed"
SETTLE = 2.0  # seconds since its last modification before a file's pass is remembered


def _code_version(check: Callable[..., object]) -> str:
    """The check's module and name, with a digest of the source file that defines it."""
    source = inspect.getsourcefile(check)
    text = Path(source).read_bytes() if source else b""
    return f"{check.__module__}.{check.__qualname__}:{hashlib.sha256(text).hexdigest()[:16]}"


def check_once(path: Path, check: Callable[..., object], *args: Any, memo: Path | None = None) -> None:
    """`check(*args)`, which raises when the file at `path` fails it, unless it passed before
    on this very file and code (module docstring); a pass is remembered."""
    try:
        if not keeping_enabled():
            raise OSError("keeping is off")
        memo = memo if memo is not None else cache_folder() / "checked.json"
        key = f"{_code_version(check)}|{Path(path).resolve()}={file_identity(Path(path))}"
    except (OSError, QkvError):  # no cache folder, or the file cannot be looked at: just check
        check(*args)
        return
    entries = read_memo(memo, lambda value: value == PASSED)
    if key in entries:
        return
    check(*args)
    if time.time() - Path(path).stat().st_mtime < SETTLE:
        return  # just written: its identity may not change with its next write (module docstring)
    entries[key] = PASSED
    write_memo(memo, entries)
