"""qkv.runtime.native.build's checks before a kernel library is used: a truncated or replaced file
fails its checksum, found without dlopen (which would SIGBUS on a truncated file), and a
library that loads but computes wrong in any variant fails its self-test. A foreign library
with a forged checksum is tests/hostile/test_strangers.py's (it needs a process that has not
loaded qkv's operators)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qkv.runtime.native import native_kernels
from qkv.runtime.native import build

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



BROKEN = """
import json, sys
from pathlib import Path
from qkv.runtime.native import build
build.HERE = Path(sys.argv[1])  # the sources, one variant broken on purpose
build.FLAGS = tuple("-O0" if flag == "-O3" else flag for flag in build.FLAGS)  # minutes less to build; the self-test is under test
status = build.native_kernels()
from qkv.runtime.linear import Int8Linear
from torch import nn
print(json.dumps({"available": status.available, "reason": status.reason,
                  "native": Int8Linear.from_linear(nn.Linear(8, 4)).native}))
"""


def test_a_library_that_fails_its_self_test_is_never_used(tmp_path: Path) -> None:
    """A library whose generic int8 product is wrong (the vectorised ones right) builds and
    loads, but its self-test runs every variant: it is not used, one line says which product
    in which variant failed, and the layers run the PyTorch reference."""
    import json
    import os
    import subprocess
    import sys

    sources = tmp_path / "sources"
    shutil.copytree(build.HERE, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    products = sources / "products.cpp"
    right = "y[m * N + n] = total * scales[n] + (bias ? bias[n] : 0.f);"
    assert products.read_text().count(right) == 1
    products.write_text(products.read_text().replace(right, right.replace("total * scales[n]", "total * scales[n] * 1.5f")))
    done = subprocess.run([sys.executable, "-c", BROKEN, str(sources)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "QKV_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    reason = "the int8 product failed its self-test (generic C++ variant)"
    assert result == {"available": False, "reason": reason, "native": False}
    said = [line for line in done.stderr.splitlines() if "not using the native kernels" in line]
    assert said == [f"qkv: not using the native kernels: {reason}; PyTorch runs the same math instead, slower"]
