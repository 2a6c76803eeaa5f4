"""Building qkv's kernels: once per machine into the cache folder (a second process loads what
the first built), one clear reason where they cannot be built, and a compiler failure that
leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.native import build

STATUS = ("import json; from qkv.native import native_kernels; s = native_kernels(); "
          "print(json.dumps({'available': s.available, 'reason': s.reason, 'built': s.built_seconds, "
          "'path': str(s.path)}))")


def _run(script: str, env: dict[str, str]) -> dict:
    """The JSON line `script` prints last, run in a fresh Python with `env` added."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _status(env: dict[str, str]) -> dict:
    return _run(STATUS, env)


@pytest.mark.skipif(build.unavailable_reason() is not None, reason="this machine cannot build qkv's kernels")
def test_built_once_then_loaded_from_the_cache_folder(tmp_path: Path) -> None:
    first = _status({"QKV_CACHE_DIR": str(tmp_path)})
    second = _status({"QKV_CACHE_DIR": str(tmp_path)})
    assert first["available"] and second["available"]
    assert first["built"] is not None and second["built"] is None  # the second process only loads
    assert first["path"] == second["path"] and Path(first["path"]).parent == tmp_path / "native"
    name = Path(first["path"]).name
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [name, name + ".sha256"]  # no temporaries


def test_turned_off_by_the_environment_with_the_reason(tmp_path: Path) -> None:
    status = _status({"QKV_NATIVE": "0", "QKV_CACHE_DIR": str(tmp_path)})
    assert status == {"available": False, "reason": "turned off with QKV_NATIVE=0", "built": None, "path": "None"}
    assert not (tmp_path / "native").exists()


def test_a_failing_compiler_gives_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "broken-cxx"
    script.write_text("#!/bin/sh\necho 'kernels.cpp:1: error: this compiler is broken' >&2\nexit 1\n")
    script.chmod(0o755)
    target = tmp_path / "cache" / "native" / "qkv_kernels_x.so"
    with pytest.raises(RuntimeError, match="^the C\\+\\+ compiler failed: kernels.cpp:1: error: this compiler is broken$"):
        build._build(str(script), target, build.FLAGS)
    assert list((tmp_path / "cache" / "native").iterdir()) == []


def test_the_cache_key_follows_the_compiler(tmp_path: Path) -> None:
    other = tmp_path / "cxx"
    other.write_text("#!/bin/sh\necho 'another compiler 1.0'\n")
    other.chmod(0o755)
    compiler = build.cxx_compiler() or "c++"
    assert build._key(compiler, build.FLAGS) == build._key(compiler, build.FLAGS)
    assert build._key(compiler, build.FLAGS) != build._key(str(other), build.FLAGS)


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "q"))
    assert build.cache_folder() == tmp_path / "q"
    monkeypatch.delenv("QKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert build.cache_folder() == tmp_path / "x" / "qkv"


PRODUCT = ("import json, torch; from qkv.native import native_kernels; "
           "from qkv.native.ops import int4_linear, int4_linear_reference; s = native_kernels(); "
           "g = torch.Generator().manual_seed(3); x = torch.randn(5, 608, generator=g); "  # 19 blocks a row
           "q = torch.randint(0, 256, (13, 304), dtype=torch.uint8, generator=g); "
           "d = (torch.rand(13, 19, generator=g) / 50).half(); m = (torch.randn(13, 19, generator=g) / 50).half(); "
           "got, want = int4_linear(x, q, d, m, None), int4_linear_reference(x, q, d, m, None); "
           "print(json.dumps({'isa': s.isa, 'available': s.available, "
           "'error': (got - want).abs().max().item(), 'scale': want.abs().max().item()}))")


@pytest.mark.skipif(build.unavailable_reason() is not None, reason="this machine cannot build qkv's kernels")
@pytest.mark.parametrize("isa", ["avx2", "auto"])
def test_each_instruction_set_computes_the_int4_product(isa: str, tmp_path: Path) -> None:
    """The AVX2 build is checked on an AVX-512 machine too (QKV_NATIVE_ISA=avx2), and the
    CPU's best build (auto) is the AVX-512 VNNI one exactly where /proc/cpuinfo lists it."""
    result = _run(PRODUCT, {"QKV_NATIVE_ISA": isa, "QKV_CACHE_DIR": str(tmp_path)})
    vnni = build.VNNI_CPU <= build._cpu_flags()
    assert result["available"] and result["isa"] == ("AVX-512 VNNI" if isa == "auto" and vnni else "AVX2")
    assert result["error"] <= 1e-5 * result["scale"]


@pytest.mark.skipif(build.unavailable_reason() is not None, reason="this machine cannot build qkv's kernels")
def test_an_unknown_instruction_set_is_named(tmp_path: Path) -> None:
    status = _status({"QKV_NATIVE_ISA": "sse9", "QKV_CACHE_DIR": str(tmp_path)})
    assert status == {"available": False, "reason": "QKV_NATIVE_ISA must be one of auto, avx2, got 'sse9'",
                      "built": None, "path": "None"}
