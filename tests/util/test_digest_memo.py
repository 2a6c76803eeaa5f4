"""A remembered digest is the file's real content digest, and any change to the file is seen."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qkv.util.cache_integrity import content_digest
from qkv.util.digest_memo import MAX_ENTRIES, file_identity, remembered_digest


def _file(tmp_path: Path, data: bytes = b"weights " * 1000) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    return path


def test_the_remembered_digest_is_the_content_digest_and_is_read_from_the_memo(tmp_path: Path) -> None:
    path, memo = _file(tmp_path), tmp_path / "cache" / "digests.json"
    first = remembered_digest([path], memo)
    assert first == content_digest([path])
    entries = json.loads(memo.read_text())
    (key,) = entries
    assert file_identity(path) in key
    entries[key] = "f" * 64  # what the memo says is what a second start returns: the file is not read
    memo.write_text(json.dumps(entries))
    assert remembered_digest([path], memo) == "f" * 64


def test_a_same_size_change_with_the_old_modification_time_is_seen(tmp_path: Path) -> None:
    path, memo = _file(tmp_path), tmp_path / "digests.json"
    before = remembered_digest([path], memo)
    stat = path.stat()
    with open(path, "r+b") as handle:  # one byte changed in place, size kept
        handle.seek(100)
        handle.write(b"X")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `touch -r` / `cp -p` would
    after = remembered_digest([path], memo)
    assert after == content_digest([path]) != before


def test_a_file_renamed_into_place_is_hashed_again(tmp_path: Path) -> None:
    path, memo = _file(tmp_path), tmp_path / "digests.json"
    before = remembered_digest([path], memo)
    other = tmp_path / "other"
    other.write_bytes(b"other weights " * 500)
    os.replace(other, path)
    assert remembered_digest([path], memo) == content_digest([path]) != before


def test_a_damaged_memo_is_ignored_and_the_memo_stays_bounded(tmp_path: Path) -> None:
    memo = tmp_path / "digests.json"
    memo.write_text("{not json")
    paths = []
    for i in range(MAX_ENTRIES + 5):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * 10)
        paths.append(p)
        assert remembered_digest([p], memo) == content_digest([p])
    assert len(json.loads(memo.read_text())) == MAX_ENTRIES
