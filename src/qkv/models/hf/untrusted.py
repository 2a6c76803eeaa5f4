"""Reading files that came from anywhere: contained, bounded, and one clear error.

Model folders and GGUF files are downloaded from strangers. Everything qkv takes from
them goes through these checks before it is used:

- a path named inside a folder's metadata stays inside that folder (resolved, links
  followed, then checked), and the refusal reads the same whether or not the target exists;
- a JSON file is read only up to a size limit, and nesting deeper than Python's parser can
  take is an error, not a crash;
- the memory a model will need is estimated from its validated config and compared with
  what the machine has (or what the caller allows) before anything is allocated.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

MAX_JSON_BYTES = 64 * 2**20  # config.json, index, tokenizer_config.json: far below this
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def inside(folder: Path, entry: Any, *, what: str) -> Path:
    """`folder / entry` when it stays inside `folder` after resolving links; else QkvError.

    The check looks at the path only, never at the target, so the error is the same for a
    target that exists and one that does not.
    """
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise QkvError(f"{what} must be a file name inside {folder}, got {_preview(entry)}")
    root = folder.resolve()
    target = (root / entry).resolve()
    if target == root or not target.is_relative_to(root):
        raise QkvError(f"{what} points at {entry!r}, outside the model folder {folder}; refusing to open it")
    return target


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file of at most `max_bytes`; any problem is a QkvError naming the file."""
    if not path.is_file():
        raise QkvError(f"{path} is not a file")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise QkvError(f"{path} is {size:,} bytes; qkv reads JSON files of at most {max_bytes:,} bytes")
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
        return json.loads(raw.decode("utf-8"))
    except QkvError:
        raise
    except RecursionError:
        raise QkvError(f"cannot read {path}: its JSON is nested too deeply") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QkvError(f"cannot read {path}: {error}") from None


def read_json_object(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    data = read_json(path, max_bytes=max_bytes)
    if not isinstance(data, dict):
        raise QkvError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- memory


def parse_size(text: str) -> int:
    """'2GB', '1.5 GiB', '512M', '1000000' -> bytes (binary multiples: 1 GB = 2**30 bytes)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size; write it like 2GB, 512MB or 1073741824")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 1 <= value < 2**63:
        raise ValueError(f"{text!r} is out of range")
    return int(value)


def format_size(n: float) -> str:
    for unit, scale in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} bytes"


def available_memory() -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by RLIMIT_AS if set."""
    available: int | None = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        available = None
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm", encoding="ascii") as handle:
                used = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            room = max(soft - used, 0)
            available = room if available is None else min(available, room)
    except (ImportError, OSError, ValueError):
        pass
    return available


def require_memory(needed: int, *, max_memory: int | None, what: str) -> None:
    """Refuse `what` when its estimated `needed` bytes exceed the limit or the machine."""
    if max_memory is not None:
        if needed > max_memory:
            raise QkvError(
                f"{what} needs about {format_size(needed)} of memory, more than --max-memory "
                f"{format_size(max_memory)}"
            )
        return
    available = available_memory()
    if available is not None and needed > available:
        raise QkvError(
            f"{what} needs about {format_size(needed)} of memory but this machine has "
            f"{format_size(available)} available; it would not fit (--max-memory sets the limit)"
        )
