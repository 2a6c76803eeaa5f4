"""Write a file so that readers see the old version or the new one, never half of one.

The bytes go to a temporary file in the same folder, are flushed to disk, and the file
is renamed over the target (os.replace is atomic on one filesystem). An interrupted
write leaves the previous file as it was.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_with(path: str | Path, write: Callable[[str], object]) -> None:
    """Let `write(tmp_path)` produce the file, then move it into place."""
    target = Path(path)
    tmp = str(target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"))
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, as for open()
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
