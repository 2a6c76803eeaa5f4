"""Building and loading qkv's native kernels once per machine (see qkv.runtime.native).

The shared library is written to `<cache>/native/qkv_kernels_<key>.so`, where <cache> is
`$QKV_CACHE_DIR`, else `$XDG_CACHE_HOME/qkv`, else `~/.cache/qkv`, and <key> hashes the
sources, the compiler's version, the flags and the torch version: a changed source or a new
torch builds anew, and two processes building at once each write a temporary file and
rename it into place (the last rename wins, both are the same library).

Beside the library, `<name>.so.sha256` holds the SHA-256 of its bytes, written before the
library is renamed into place, and `<name>.so.log` what the compilers said (their warnings). A library is loaded only when its bytes match (a truncated
file would otherwise SIGBUS the process in dlopen; another library under the name would
register other operators) and then only used when its self-test passes. One that fails its
checksum or does not load is deleted and rebuilt; one that loads but fails its self-test is
kept (a rebuild would give the same library) and not used; either way one line on stderr
says so. Temporary files of
builds that were killed are removed (qkv.util.cache_integrity), and a relative cache folder
(`XDG_CACHE_HOME=cache`) is refused, so that nothing is loaded from the current folder.

The sources (`SOURCES`, compiled together into one library; a new op is a new file in that
list that registers itself with STABLE_TORCH_LIBRARY_FRAGMENT) are built for the baseline
CPU with warnings on; each op's vectorised variants (AVX2, AVX-512 VNNI) carry their
instruction set as a target attribute and are picked at run time from what the CPU reports,
beside a generic variant in plain C++ (kernels.h). `use_variant` caps the variant (tests;
the self-test runs every variant this CPU has against PyTorch before the library is used).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.runtime.native import iq_grids
from qkv.util.atomic import atomic_write_text, temporary_name
from qkv.util.cache_integrity import cache_folder, file_sha256, remove_stale_temporaries, say_discarded
from qkv.util.progress import slow_step

HERE = Path(__file__).parent / "csrc"  # the C++ sources, shipped with the package
# Compiled together, in this order: the products, attention, the layer (ring_copy.cpp: what a
# ring's prompt past its window reads) and the whole stack of layers with the head (sharing kernels.h); products straight from GGUF's stored blocks
# (block_format.cpp: the block-format table and the generic reference; block_products.cpp: the
# op and the dispatch, one row at a time or in tiles of many; blocks_x86/: block_avx2.cpp and block_avx512.cpp,
# the x86 variants, sharing block_x86.h and block_tiles_x86.h; repacked/: Q4_K, Q5_K, Q8_0, Q5_0,
# IQ4_XS and Q6_K repacked at load into interleaved rows, their layouts, generic products and ops,
# repacked/x86/ their AVX2 and AVX-512 products); attention over a quantized KV cache's packed codes.
SOURCES: tuple[str, ...] = ("products.cpp", "products_x86.cpp", "attention.cpp", "layer.cpp", "ring_copy.cpp",
                            "stack.cpp",
                            "block_format.cpp", "block_products.cpp", "blocks_x86/block_avx2.cpp", "blocks_x86/block_avx512.cpp",
                            "quantized_cache/attention.cpp", "repacked/q4k_layout.cpp", "repacked/x86/q4k_avx2.cpp", "repacked/x86/q4k_avx512.cpp",
                            "repacked/q8_0_layout.cpp", "repacked/x86/q8_0_avx2.cpp", "repacked/x86/q8_0_avx512.cpp",
                            "repacked/iq4xs_layout.cpp", "repacked/x86/iq4xs_avx2.cpp", "repacked/x86/iq4xs_avx512.cpp",
                            "repacked/q6k_layout.cpp", "repacked/x86/q6k_avx2.cpp", "repacked/x86/q6k_avx512.cpp", "repacked/ops.cpp")
HEADERS: tuple[str, ...] = ("kernels.h", "block_format.h", "blocks_x86/block_x86.h", "blocks_x86/block_grid_x86.h", "blocks_x86/block_float_x86.h", "blocks_x86/block_k2_x86.h", "blocks_x86/block_float_avx512.h", "blocks_x86/block_grid_avx512.h", "blocks_x86/block_tiles_x86.h", "quantized_cache/attention_simd.h",
                            "repacked/q4k.h", "repacked/q8_0.h", "repacked/iq4xs.h", "repacked/q6k.h", "repacked/x86/target_begin.h", "repacked/x86/target_end.h")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra")
VARIANTS = ("generic", "avx2", "avx512")  # slowest first, the names qkv::set_variant takes
VARIANT_NAMES = {"generic": "generic C++", "avx2": "AVX2", "avx512": "AVX-512 VNNI"}
BUILD_TIMEOUT_S = 300
# what a build leaves in the cache folder, part of the key: a library from a build that left less is built again
BUILD_LAYOUT = "library, .sha256, .log"
BUILD_MINUTES = 3  # one g++ over every source: 160 s measured on two cores (issue 37)
_OFF = {"0", "false", "no", "off"}
LOADED = False  # set once the kernels are loaded and self-tested in this process


@dataclass(frozen=True)
class NativeStatus:
    """Whether qkv's native kernels are loaded in this process, and if not, why."""

    available: bool
    reason: str | None = None  # why not, in a few words
    path: Path | None = None  # the shared library loaded
    built_seconds: float | None = None  # set when this process compiled it
    isa: str = "generic C++"  # the variant the ops run: "generic C++", "AVX2" or "AVX-512 VNNI"

    def describe(self) -> str:
        """What runs the products: the variant active now (`use_variant` or `--variant` may
        cap it below the CPU's best, `isa`)."""
        if not self.available:
            return f"PyTorch's kernels ({self.reason})"
        return f"qkv's {VARIANT_NAMES.get(torch.ops.qkv.active_variant.default(), self.isa)} kernels"


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def unavailable_reason() -> str | None:
    """None when this machine can build and run the kernels, else why not."""
    if os.environ.get("QKV_NATIVE", "").strip().lower() in _OFF:
        return "turned off with QKV_NATIVE=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"qkv's kernels are built on Linux x86-64 only, this is {sys.platform} {platform.machine()}"
    include, _ = _torch_dirs()
    ops = include / "torch" / "csrc" / "stable" / "ops.h"
    if not ops.is_file() or "torch_parallel_for" not in ops.read_text(encoding="utf-8", errors="replace"):
        return f"torch {torch.__version__} has no stable C ABI with parallel_for (needs torch 2.10 or later)"
    if os.environ.get("CXX") and shutil.which(os.environ["CXX"]) is None:
        return f"no C++ compiler found: CXX={os.environ['CXX']} is not a program (set CXX, or install g++)"
    if cxx_compiler() is None:
        return "no C++ compiler found (set CXX, or install g++)"
    return None


def flags() -> tuple[str, ...]:
    """The compiler flags: the same on every machine (the variants are chosen at run time)."""
    return FLAGS


def cxx_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _key(compiler: str, build_flags: tuple[str, ...]) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256()
    sources = b"".join(name.encode() + b"\0" + (HERE / name).read_bytes() for name in SOURCES + HEADERS)
    sources += b"\0" + iq_grids.source_bytes()  # the generated header's source
    for part in (BUILD_LAYOUT.encode(), sources, compiler.encode(), version.encode(), " ".join(build_flags).encode(),
                 torch.__version__.encode(), str(_torch_dirs()[1]).encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_announcement() -> str:
    """What stderr says before the compiler starts (the build runs minutes, once)."""
    return (f"building qkv's kernels for this CPU (once per machine, about {BUILD_MINUTES} minutes; "
            "QKV_NATIVE=0 skips them)")


def build_library(compiler: str, target: Path, build_flags: tuple[str, ...], *,
                  announce: Callable[[], contextlib.AbstractContextManager[object]] | None = None) -> None:
    """Compile SOURCES into `target`, atomically; raises RuntimeError with the compiler's
    first error line. Each source is compiled to an object of its own, as many at once as this
    process may use cores (one g++ over every source ran them one after another), then linked.
    `announce()` is entered just before the compiler starts and left when it ends
    (native_kernels: a line on stderr, counting seconds on a terminal)."""
    include, lib = _torch_dirs()
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = str(temporary_name(target))
    compile_flags = [flag for flag in build_flags if flag != "-shared"]
    # the largest sources first, so that the last to finish is a small one
    sources = sorted(SOURCES, key=lambda name: -(HERE / name).stat().st_size)
    try:
        with tempfile.TemporaryDirectory(prefix="qkv-kernels-") as folder, \
                announce() if announce is not None else contextlib.nullcontext():
            objects = {name: os.path.join(folder, f"{index}.o") for index, name in enumerate(sources)}
            Path(folder, iq_grids.NAME).write_text(iq_grids.render())  # the grid types' tables, from the gguf package

            def compile_one(name: str) -> subprocess.CompletedProcess[str]:
                command = [compiler, *compile_flags, "-c", "-isystem", str(include), "-iquote", folder, str(HERE / name),
                           "-o", objects[name]]
                return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)

            with concurrent.futures.ThreadPoolExecutor(max_workers=_build_jobs()) as pool:
                compiled = dict(zip(sources, pool.map(compile_one, sources)))
            done = next((compiled[name] for name in SOURCES if compiled[name].returncode != 0), None)  # in the sources' order
            if done is None:  # every object compiled: link them
                link = [compiler, *build_flags, *(objects[name] for name in SOURCES), "-o", temporary, f"-L{lib}",
                        "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
                done = subprocess.run(link, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise RuntimeError(f"the C++ compiler failed: {errors[0].strip() if errors else done.returncode}")
        said = "".join(compiled[name].stderr for name in SOURCES) + done.stderr
        atomic_write_text(build_log_path(target), said)  # the compilers' warnings, if any (a test asserts none)
        atomic_write_text(_checksum_path(target), file_sha256(Path(temporary)) + "\n")
        os.replace(temporary, target)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"the C++ compiler took more than {BUILD_TIMEOUT_S} s") from error
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _build_jobs() -> int:
    """How many compilers run at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _self_test() -> str | None:
    """A few tiny products and one attention against PyTorch, in every variant this CPU runs,
    so that a library that loads but computes wrong (a broken compiler, a changed ABI, a
    variant the CPU reports but runs wrong) is never used. None when all pass, else which."""
    from qkv.runtime.native.ops import (decode_attention, f32_linear, int4_linear, int4_linear_reference, int8_linear,
                                use_variant, variants)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 72, generator=generator)  # 72: the vector steps and a scalar tail
    w = torch.randint(-127, 128, (9, 72), dtype=torch.int8, generator=generator)
    wf = torch.randn(9, 72, generator=generator)
    scales, bias = torch.rand(9, generator=generator), torch.randn(9, generator=generator)
    # 9 blocks a row and 9 outputs: the four-block (VNNI), two-block and one-block steps all run
    x4 = torch.randn(3, 288, generator=generator)
    q = torch.randint(0, 256, (9, 144), dtype=torch.uint8, generator=generator)
    d = torch.rand(9, 9, generator=generator).half()
    m = torch.randn(9, 9, generator=generator).half()
    qa, ka, va = (torch.randn(2, 4, 16, generator=generator), torch.randn(2, 2, 11, 16, generator=generator),
                  torch.randn(2, 2, 11, 16, generator=generator))
    weights = torch.softmax(qa.reshape(2, 2, 2, 16) @ ka.transpose(-1, -2) * 0.25, dim=-1)  # (B, H_kv, group, S)
    attended = (weights @ va).reshape(2, 4, 16)
    checks = (
        ("int8 product", lambda: int8_linear(x, w, scales, bias), x @ (w.float() * scales[:, None]).t() + bias, 1e-4),
        ("float32 product", lambda: f32_linear(x, wf, bias), x @ wf.t() + bias, 1e-4),
        ("int4 product", lambda: int4_linear(x4, q, d, m, bias), int4_linear_reference(x4, q, d, m, bias), 1e-3),
        ("attention", lambda: decode_attention(qa, ka, va, None, 0.25), attended, 1e-4),
    )
    for variant in variants():
        with use_variant(variant):
            for name, run, expected, tolerance in checks:
                if not torch.allclose(run(), expected, atol=tolerance, rtol=1e-4):
                    return f"the {name} failed its self-test ({VARIANT_NAMES[variant]} variant)"
    return None


def _checksum_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def build_log_path(target: Path) -> Path:
    """What the compilers said while building the library at `target` (empty: no warning)."""
    return target.with_name(target.name + ".log")


def _damage(target: Path) -> str | None:
    """Why the library at `target` may not be loaded (its bytes do not match its checksum),
    or None when they match."""
    try:
        expected = _checksum_path(target).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "it has no checksum file"
    try:
        actual = file_sha256(target)
    except OSError as error:
        return f"it cannot be read: {error.strerror}"
    return None if actual == expected else "its bytes do not match its checksum"


def _discard(target: Path) -> None:
    for path in (target, _checksum_path(target), build_log_path(target)):
        try:
            path.unlink()
        except OSError:
            pass


def _load_checked(target: Path) -> str | None:
    """Load the library and run the self-test; None when both pass, else why not."""
    try:
        torch.ops.load_library(str(target))
        from qkv.runtime.native.ops import register_fakes

        register_fakes()
        return _self_test()
    except Exception as error:  # noqa: BLE001 - a library of another build: missing operators, bad symbols
        lines = str(error).strip().splitlines()
        return f"it does not work: {lines[0][:160] if lines else type(error).__name__}"


@functools.lru_cache(maxsize=1)
def native_kernels() -> NativeStatus:
    """Load qkv's kernels, building them first if this machine has not yet (see the module
    docstring). Never raises: a status says why they are not available."""
    reason = unavailable_reason()
    if reason is not None:
        return NativeStatus(False, reason)
    compiler = cxx_compiler()
    assert compiler is not None
    build_flags = flags()
    target = cache_folder() / "native" / f"qkv_kernels_{_key(compiler, build_flags)}.so"
    built = None
    remove_stale_temporaries(target.parent)
    damage = _damage(target) if target.is_file() else None
    if damage is not None:
        _discard(target)
        say_discarded(target, damage, "building qkv's kernels again")
    try:
        if not target.is_file():
            start = time.perf_counter()
            build_library(compiler, target, build_flags,
                          announce=lambda: slow_step(build_announcement(), after=0))
            built = time.perf_counter() - start
            damage = _damage(target)  # what was renamed into place is what was hashed
            if damage is not None:
                raise RuntimeError(f"the library just built is damaged: {damage}")
    except (OSError, RuntimeError) as error:
        return NativeStatus(False, str(error).splitlines()[0] if str(error) else type(error).__name__)
    failure = _load_checked(target)
    if failure is not None and failure.startswith("it does not work"):
        _discard(target)  # a library of another build: the next process builds this one
        say_discarded(target, failure, "PyTorch runs the same math instead; the next run builds qkv's again")
    elif failure is not None:  # a self-test that computes wrong stays: rebuilding gives the same library
        print(f"qkv: not using the native kernels: {failure}; PyTorch runs the same math instead, slower",
              file=sys.stderr)
    if failure is not None:
        return NativeStatus(False, failure, target)
    global LOADED
    LOADED = True
    from qkv.runtime.native.ops import active_variant

    return NativeStatus(True, None, target, built, VARIANT_NAMES[active_variant()])
