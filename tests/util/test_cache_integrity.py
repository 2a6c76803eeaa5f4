"""qkv.util.cache_integrity: the content digest is SHA-256 over every byte (checked against hashlib
by hand), a same-size, same-mtime replacement always changes it and the prepared-weights key
(hypothesis over files), stale temporaries of dead writers go and live ones stay, relative
cache folders are refused."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from qkv.util import cache_integrity
from qkv.util.cache_integrity import absolute_folder, content_digest, remove_stale_temporaries
from qkv.errors import QkvError


def _by_hand(paths: list[Path], chunk: int) -> str:
    total = hashlib.sha256()
    for path in paths:
        data = path.read_bytes()
        total.update(len(data).to_bytes(8, "little"))
        for start in range(0, len(data), chunk):
            total.update(hashlib.sha256(data[start:start + chunk]).digest())
    return total.hexdigest()


def test_the_digest_is_sha256_of_every_chunk(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cache_integrity, "CHUNK_BYTES", 1000)
    files = [tmp_path / "a", tmp_path / "b"]
    files[0].write_bytes(os.urandom(4567))
    files[1].write_bytes(b"")
    assert content_digest(files, threads=3) == _by_hand(files, 1000)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=3000), where=st.integers(min_value=0), flip=st.integers(1, 255))
def test_a_same_size_same_mtime_swap_changes_the_key(tmp_path: Path, monkeypatch, data: bytes, where: int,
                                                     flip: int) -> None:
    from qkv.runtime import prepared_cache

    monkeypatch.setattr(cache_integrity, "CHUNK_BYTES", 512)
    monkeypatch.setattr(prepared_cache, "SMALLEST_SOURCE", 0)
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QKV_PREPARED_CACHE", raising=False)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    stat = path.stat()
    before = prepared_cache.prepared_path([path], "int8")
    swapped = bytearray(data)
    swapped[where % len(data)] ^= flip
    path.write_bytes(bytes(swapped))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert prepared_cache.prepared_path([path], "int8") != before


def test_only_temporaries_of_dead_or_old_writers_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / ".x.safetensors.999999999.deadbeef.tmp"
    live = tmp_path / f".x.safetensors.{os.getpid()}.0badf00d.tmp"
    old_live = tmp_path / f".y.safetensors.{os.getpid()}.0badf00d.tmp"
    legacy = tmp_path / "tmpab12cd34.tmp"
    fresh_legacy = tmp_path / "tmpzz12cd34.so"
    other = tmp_path / "notes.tmp"
    for path in (dead, live, old_live, legacy, fresh_legacy, other):
        path.write_bytes(b"x")
    for path in (old_live, legacy):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    assert sorted(remove_stale_temporaries(tmp_path)) == sorted([dead.name, old_live.name, legacy.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, fresh_legacy.name, other.name])


def test_a_relative_cache_folder_is_refused(monkeypatch) -> None:
    from qkv.util.cache_integrity import cache_folder

    with pytest.raises(QkvError, match="XDG_CACHE_HOME is the relative path 'cache'"):
        absolute_folder("cache", "XDG_CACHE_HOME")
    monkeypatch.delenv("QKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "here/cache")
    with pytest.raises(QkvError, match="relative path"):
        cache_folder()
    monkeypatch.setenv("XDG_CACHE_HOME", "/abs/cache")
    assert cache_folder() == Path("/abs/cache/qkv")
