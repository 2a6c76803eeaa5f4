"""Write a file so that readers see the old version or the new one, never half of one.

The bytes go to a temporary file in the same folder, are flushed to disk, and the file
is renamed over the target (os.replace is atomic on one filesystem). An interrupted
write leaves the previous file as it was; a process killed mid-write can leave its
temporary file behind, which `remove_temporaries` (run by whoever next owns the folder)
deletes. Files get the mode `open()` would give them (0666 less the umask), even when the
writing library creates its file with tighter permissions.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


_TEMPORARY = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{8}\.tmp")


def temporary_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def remove_temporaries(folder: str | Path) -> list[str]:
    """Delete the temporary files this module leaves when a writer is killed; their names."""
    removed = []
    for entry in Path(folder).iterdir():
        if _TEMPORARY.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry.name)
    return removed


def atomic_write_with(path: str | Path, write: Callable[[str], object]) -> None:
    """Let `write(tmp_path)` produce the file, then move it into place."""
    target = Path(path)
    tmp = str(temporary_name(target))
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies, as for open()
    mode = os.fstat(fd).st_mode & 0o777
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # safetensors, for one, recreates the file as 0600
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
