"""A check a file passed is not run again on the same bytes and code, and every way the bytes
can change makes it run again: the real block-scale check (qkv.models.gguf.scales) on a GGUF
file written with the gguf package, patched in place with its old modification time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from qkv.errors import QkvError
from qkv.models.gguf.checkpoint import open_gguf_file
from qkv.models.gguf.dequantize import BLOCK_FORMATS
from qkv.util.checked_memo import SETTLE, check_once
from qkv.util.digest_memo import MAX_ENTRIES
from tests.models.gguf.block_files import write_block_gguf
from tests.models.gguf.test_scales import patch

CALLS: list[Path] = []


def counted_check(path: Path) -> None:
    """A check that passes and says it ran."""
    CALLS.append(path)


def failing_check(path: Path) -> None:
    CALLS.append(path)
    raise QkvError(f"{path}: refused")


def _settled(path: Path) -> Path:
    """Modified SETTLE seconds and more ago, as a downloaded file is."""
    old = time.time() - 10 * SETTLE
    os.utime(path, (old, old))
    return path


def _file(tmp_path: Path, name: str = "m.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(b"weights " * 100)
    return _settled(path)


@pytest.fixture(autouse=True)
def _fresh_calls(monkeypatch):
    monkeypatch.delenv("QKV_PREPARED_CACHE", raising=False)
    CALLS.clear()


def test_a_pass_is_remembered_and_a_failure_is_not(tmp_path: Path) -> None:
    path, memo = _file(tmp_path), tmp_path / "cache" / "checked.json"
    check_once(path, counted_check, path, memo=memo)
    check_once(path, counted_check, path, memo=memo)
    assert CALLS == [path]
    (key,) = json.loads(memo.read_text())
    assert "counted_check" in key and str(path.resolve()) in key
    other = _file(tmp_path, "other.bin")
    for _ in range(2):
        with pytest.raises(QkvError, match="refused"):
            check_once(other, failing_check, other, memo=memo)
    assert CALLS == [path, other, other]


def test_a_file_just_written_is_checked_every_time(tmp_path: Path) -> None:
    path, memo = tmp_path / "new.bin", tmp_path / "checked.json"
    path.write_bytes(b"fresh")
    check_once(path, counted_check, path, memo=memo)
    check_once(path, counted_check, path, memo=memo)
    assert CALLS == [path, path] and not memo.exists()


def test_a_scale_patched_in_place_with_the_old_times_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    path = write_block_gguf(tmp_path / "m.gguf", embedding=Q.Q8_0,
                            layer_types={k: Q.Q4_K for k in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                             "ffn_gate", "ffn_up", "ffn_down")})
    _settled(path)
    open_gguf_file(path).read_stored(embedding=True)  # passes; remembered in the cache folder
    assert "check_finite" in next(iter(json.loads((tmp_path / "cache" / "checked.json").read_text())))
    stat = path.stat()
    patch(path, "blk.0.attn_q.weight", 3 * BLOCK_FORMATS[Q.Q4_K].size, np.array([np.float16("nan")]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same modification time
    with pytest.raises(QkvError, match=r"blk.0.attn_q.weight \(Q4_K\): block 3 has a NaN float16 scale d"):
        open_gguf_file(path).read_stored(embedding=True)


def test_a_file_renamed_into_place_is_checked_again(tmp_path: Path) -> None:
    path, memo = _file(tmp_path), tmp_path / "checked.json"
    check_once(path, counted_check, path, memo=memo)
    os.replace(_file(tmp_path, "replacement.bin"), path)
    check_once(path, counted_check, path, memo=memo)
    assert CALLS == [path, path]


def test_a_damaged_memo_is_ignored_and_the_memo_stays_bounded(tmp_path: Path) -> None:
    memo = tmp_path / "checked.json"
    memo.write_text("{not json")
    for i in range(MAX_ENTRIES + 5):
        check_once(_file(tmp_path, f"f{i}"), counted_check, tmp_path, memo=memo)
    assert len(CALLS) == MAX_ENTRIES + 5 and len(json.loads(memo.read_text())) == MAX_ENTRIES


def test_keeping_off_remembers_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QKV_PREPARED_CACHE", "0")
    path, memo = _file(tmp_path), tmp_path / "checked.json"
    check_once(path, counted_check, path, memo=memo)
    check_once(path, counted_check, path, memo=memo)
    assert CALLS == [path, path] and not memo.exists()
