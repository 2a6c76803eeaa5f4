"""The Makefile as a newcomer runs it: every long install says what it installs and shows pip's
progress (no -q), and `make install` ends by building qkv's kernels, which never fails it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("target", ["install", "install-dev"])
def test_each_install_says_what_it_does_and_shows_progress(target: str, tmp_path: Path) -> None:
    dry = _make("-n", "-W", "Makefile", target, f"VENV={tmp_path / 'venv'}")  # -n: print, run nothing
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if " -m pip install " in line and "--upgrade pip" not in line]
    assert installs
    for i in installs:
        assert " -q" not in lines[i], lines[i]  # pip's own progress shows
        assert lines[i - 1].startswith("echo \"== installing"), lines[i - 1]  # and a line says what comes
    assert any("native_kernels" in line for line in lines)  # the kernels are built at the end


def test_the_kernels_step_never_fails_the_install(tmp_path: Path) -> None:
    env = {"CXX": shutil.which("false") or "/bin/false", "QKV_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT / "src")}
    failed_build = _make("kernels", f"BIN={Path(sys.executable).parent}", env=env)
    assert failed_build.returncode == 0, failed_build.stderr
    assert "qkv runs PyTorch's kernels (the C++ compiler failed" in failed_build.stdout
    no_python = _make("kernels", f"BIN={tmp_path / 'missing'}")
    assert no_python.returncode == 0
    assert "could not set up qkv's kernels now" in no_python.stdout
