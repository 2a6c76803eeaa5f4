"""qkv.native.build's checks before a kernel library is loaded: a truncated or replaced file
fails its checksum, found without dlopen (which would SIGBUS on a truncated file). A foreign
library with a forged checksum is tests/hostile/test_strangers.py's (it needs a process
that has not loaded qkv's operators)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qkv.native import build, native_kernels

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")


@pytest.fixture
def library(tmp_path: Path) -> Path:
    built = native_kernels().path
    assert built is not None
    target = tmp_path / built.name
    shutil.copy2(built, target)
    shutil.copy2(Path(str(built) + ".sha256"), Path(str(target) + ".sha256"))
    return target


def test_an_intact_library_passes(library: Path) -> None:
    assert build._damage(library) is None


def test_a_truncated_library_fails_its_checksum(library: Path) -> None:
    library.write_bytes(library.read_bytes()[:4096])
    assert build._damage(library) == "its bytes do not match its checksum"


def test_a_library_without_its_checksum_is_not_loaded(library: Path) -> None:
    Path(str(library) + ".sha256").unlink()
    assert build._damage(library) == "it has no checksum file"

