"""Building qkv's kernels: once per machine into the cache folder (a second process loads what
the first built), one clear reason where they cannot be built, and a compiler failure that
leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.runtime.native import build
from qkv.util.cache_integrity import cache_folder

STATUS = ("import json; from qkv.runtime.native import native_kernels; s = native_kernels(); "
          "print(json.dumps({'available': s.available, 'reason': s.reason, 'built': s.built_seconds, "
          "'path': str(s.path)}))")
# a child's build at -O0 instead of -O3 (a fifth of the compile time); the key follows the flags
UNOPTIMISED = ("from qkv.runtime.native import build; "
               "build.FLAGS = tuple('-O0' if flag == '-O3' else flag for flag in build.FLAGS); ")


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
    """The build in an empty cache folder runs at -O0 (the caching is under test, not the
    optimiser; -O3's build takes minutes): the same library, the same key rules."""
    first = _run(UNOPTIMISED + STATUS, {"QKV_CACHE_DIR": str(tmp_path)})
    second = _run(UNOPTIMISED + STATUS, {"QKV_CACHE_DIR": str(tmp_path)})
    assert first["available"] and second["available"]
    assert first["built"] is not None and second["built"] is None  # the second process only loads
    assert first["path"] == second["path"] and Path(first["path"]).parent == tmp_path / "native"
    name = Path(first["path"]).name
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [name, name + ".log", name + ".sha256"]  # no temporaries


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
        build.build_library(str(script), target, build.FLAGS)
    assert list((tmp_path / "cache" / "native").iterdir()) == []


def test_the_build_is_announced_before_the_compiler_starts_and_ends_after_it(tmp_path: Path) -> None:
    """The compiler here is a real program that leaves a mark when it runs: the announcement
    must be made while no mark exists, and be left once the compiler has run."""
    mark = tmp_path / "compiler-ran"
    script = tmp_path / "slow-cxx"
    script.write_text(f"#!/bin/sh\nsleep 0.2\ntouch {mark}\necho 'error: stop here' >&2\nexit 1\n")
    script.chmod(0o755)
    events: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def recorder():
        events.append(("announced", mark.exists()))
        yield
        events.append(("finished", mark.exists()))

    with pytest.raises(RuntimeError, match="error: stop here"):
        build.build_library(str(script), tmp_path / "native" / "k.so", build.FLAGS, announce=recorder)
    assert events == [("announced", False), ("finished", True)]


def test_a_first_build_says_so_on_stderr_before_it_runs(tmp_path: Path) -> None:
    """native_kernels in a fresh process with an empty cache: the announcement line (plain, as
    stderr is a pipe) comes first, the compiler's failure is the status's reason."""
    if build.unavailable_reason() is not None:
        pytest.skip(f"this machine cannot build qkv's kernels: {build.unavailable_reason()}")
    script = tmp_path / "broken-cxx"
    script.write_text("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = --version ] && exit 0; done\n"
                      "echo 'x.cpp:1: error: broken' >&2\nexit 1\n")
    script.chmod(0o755)
    done = subprocess.run([sys.executable, "-c", STATUS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "QKV_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(script)})
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == build.build_announcement() + "..."
    assert "minutes" in build.build_announcement() and "once per machine" in build.build_announcement()
    status = json.loads(done.stdout.strip().splitlines()[-1])
    assert status["available"] is False and status["reason"] == "the C++ compiler failed: x.cpp:1: error: broken"


def test_the_cache_key_follows_the_compiler(tmp_path: Path) -> None:
    other = tmp_path / "cxx"
    other.write_text("#!/bin/sh\necho 'another compiler 1.0'\n")
    other.chmod(0o755)
    compiler = build.cxx_compiler() or "c++"
    assert build._key(compiler, build.FLAGS) == build._key(compiler, build.FLAGS)
    assert build._key(compiler, build.FLAGS) != build._key(str(other), build.FLAGS)


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "q"))
    assert cache_folder() == tmp_path / "q"
    monkeypatch.delenv("QKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_folder() == tmp_path / "x" / "qkv"


def test_the_sources_are_each_under_500_lines_and_all_in_the_build() -> None:
    """kernels.cpp's split: every source and header short, and every .cpp beside them built."""
    folder = build.HERE
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*.cpp")}
    assert on_disk == set(build.SOURCES)
    headers = {str(p.relative_to(folder)) for p in folder.rglob("*.h")}
    assert headers == set(build.HEADERS), "every header is in the build's key"
    for name in build.SOURCES + build.HEADERS:
        assert len((folder / name).read_text(encoding="utf-8").splitlines()) <= 500, name


def test_every_source_ships_in_the_package() -> None:
    """pyproject's package-data names every folder of sources: a wheel or a plain `pip install .`
    (no editable install) carries them all, or the build on the user's machine would fail."""
    import tomllib
    from pathlib import PurePosixPath

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]["qkv"]
    package = build.HERE.parents[2]  # src/qkv
    missing = []
    for name in build.SOURCES + build.HEADERS:
        path = PurePosixPath((build.HERE / name).relative_to(package).as_posix())
        if not any(len(path.parts) == len(PurePosixPath(p).parts) and path.match(p) for p in patterns):
            missing.append(str(path))
    assert missing == []


@pytest.mark.skipif(build.unavailable_reason() is not None, reason="this machine cannot build qkv's kernels")
def test_the_sources_build_without_a_warning() -> None:
    """-Wall -Wextra are on, at the real flags (-O3's warnings too): the build of the library this
    session uses kept what the compilers said beside it, and it holds no warning."""
    from qkv.runtime.native import native_kernels

    status = native_kernels()
    assert status.available and status.path is not None, status.reason
    said = build.build_log_path(status.path).read_text(encoding="utf-8")
    assert "warning" not in said, said[-2000:]


@pytest.mark.skipif(build.unavailable_reason() is not None, reason="this machine cannot build qkv's kernels")
def test_the_variant_is_named_after_what_the_cpu_runs() -> None:
    """The library is the same on every machine; the status names the variant cpuid picked:
    AVX-512 VNNI exactly where /proc/cpuinfo lists it, else AVX2 where it lists AVX2 + FMA + F16C."""
    result = _run("import json; from qkv.runtime.native import native_kernels; from qkv.runtime.native.ops import variants; "
                  "s = native_kernels(); print(json.dumps({'isa': s.isa, 'variants': variants()}))",
                  {})  # the library this session built
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    avx2 = {"avx2", "fma", "f16c"} <= flags
    vnni = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    expected = ["generic", "avx2", "avx512"][: 1 + avx2 + vnni]
    assert result == {"isa": build.VARIANT_NAMES[expected[-1]], "variants": expected}
