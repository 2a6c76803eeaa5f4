"""Reading a user's text file (training data, perplexity data) with one-line errors."""

from __future__ import annotations

from pathlib import Path

from qkv.errors import QkvError


def read_text_file(path: str | Path, *, when_empty: str) -> str:
    """The UTF-8 text of `path`; a missing, unreadable, non-UTF-8 or blank file is a QkvError.

    `when_empty` finishes the message for a blank file, since what to do depends on the caller.
    """
    p = Path(path)
    if not p.exists():
        raise QkvError(f"data file {p} does not exist; give --data a UTF-8 text file")
    if not p.is_file():
        raise QkvError(f"data path {p} is not a file; give --data a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise QkvError(f"data file {p} is not UTF-8 text (byte {error.start}); convert it first") from None
    except OSError as error:
        raise QkvError(f"cannot read data file {p}: {error.strerror}") from None
    if not text.strip():
        raise QkvError(f"data file {p} {when_empty}")
    return text
