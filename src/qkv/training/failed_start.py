"""What a failed start of `qkv train` leaves behind, and a full disk told in one line.

A run that stops before its first checkpoint removes the folders it created (and a claim in
a folder that was empty), so a refused run leaves nothing; a full disk (ENOSPC, a quota, or a
file-size limit) is one line naming the folder and the file being written.
"""

from __future__ import annotations

import errno
from pathlib import Path

from qkv.errors import QkvError


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and its parents that do not exist yet, innermost first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # EFBIG: a file-size limit (ulimit -f)
_DISK_FULL_TEXT = ("No space left on device", "File too large", "Disk quota exceeded")


def disk_full(error: BaseException) -> bool:
    """An OSError for a full disk, or a writer library's own error saying so (safetensors)."""
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        return True
    return not isinstance(error, QkvError) and any(text in str(error) for text in _DISK_FULL_TEXT)


def disk_full_message(error: BaseException, out: str | Path) -> str:
    """The first part of the one line: which disk, why, and the file being written."""
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = next((text for text in _DISK_FULL_TEXT if text in str(error)), "the disk is full")
    name = getattr(error, "filename", None)
    where = f" writing {Path(name).name}" if isinstance(name, str) else ""
    return f"the disk holding --out {out} is full ({reason}{where})"


def is_empty_folder(path: Path) -> bool:
    try:
        return path.is_dir() and not any(path.iterdir())
    except OSError:
        return False


def remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders a failed start created, innermost first, unless something is inside."""
    for folder in folders:
        try:
            folder.rmdir()  # fails, as it should, when anything is inside
        except OSError:
            return
