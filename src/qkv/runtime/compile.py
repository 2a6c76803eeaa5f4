"""Compiling a decoder for decoding: each repeated layer compiled once, with `nn.Module.compile`.

Regional compilation: every layer of the stack is compiled with the same code, so Dynamo
traces one layer and every other layer reuses its graph, and the output head gets one
more. Compiling takes the time of one layer whatever the depth (SmolLM2's 30 layers
compiled as one graph took 10 minutes on 2 cores; one layer takes seconds), and Inductor's
on-disk caches (on by default) make the next process's compile a cache lookup.

Nothing is replaced at run time: `nn.Module.compile()` is PyTorch's documented way to
compile a module in place, and the compiled layer runs the same code as the eager one.
Shapes do not change between decode steps (the KV cache is static, positions are
tensors), so one set of graphs serves every length up to the cache's capacity;
`DecodeSession` runs prompts eagerly (`torch.compiler.set_stance`), so only decode steps
are compiled.

Where no compiler works (Inductor writes and builds C++), `compile_decoder` finds out
first with a tiny probe and leaves the model eager, saying why in its report. The probe
takes over a second even with warm caches, so a success with Inductor is remembered per
machine (a marker in qkv's cache folder, keyed by the torch and Python versions and the C++
compiler's path and modification time): the next process skips it.

A damaged entry in Inductor's on-disk cache is one line too. Where Inductor recovers by
itself (a truncated graph pickle: it compiles the graph again) its own warning, a
traceback, and the `__del__` error of the half-read graph are replaced by one line naming
the cache folder (`_quiet_cache_damage`). Where the compile fails, at a region's first call
(a library that does not load), every region of the model goes eager, one line on stderr
says why, and the call runs again eagerly; compiling happens before the graph runs, so
nothing of the failed call was applied.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

CompilerBackend = str | Callable[..., Any]


@dataclass(frozen=True)
class CompileReport:
    """What `compile_decoder` did: compiled regions, or why the model stays eager."""

    compiled: bool
    backend: str
    regions: int = 0
    reason: str | None = None  # why compiling was not possible

    def describe(self) -> str:
        if self.compiled:
            return f"compiled ({self.backend}, {self.regions} regions)"
        return f"eager: compiling is not possible here ({self.reason})"


def _name(backend: CompilerBackend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")


def _describe(error: BaseException) -> str:
    """One line: the root cause's type and first line (Dynamo wraps the compiler's error)."""
    root = error
    for _ in range(10):
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None:
            break
        root = inner
    lines = [line for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else ''}"


@functools.lru_cache(maxsize=8)
def _probe(backend: CompilerBackend) -> str | None:
    """None if `backend` compiles and runs a tiny function here, else the reason."""

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2.0 + 1.0).sum(dim=-1)

    try:
        torch.compile(tiny, backend=backend, dynamic=False)(torch.ones(2, 8))
    except Exception as error:  # noqa: BLE001 - any failure means "stay eager"
        return _describe(error)
    return None


def _probe_marker() -> Path | None:
    """Where a successful Inductor probe is remembered, or None where there is no compiler
    to key it on."""
    from qkv.runtime.native.build import cxx_compiler
    from qkv.util.cache_integrity import cache_folder

    named = cxx_compiler()
    compiler = shutil.which(named) if named is not None else None
    if compiler is None:
        return None
    try:
        stamp = os.stat(compiler).st_mtime_ns
    except OSError:
        return None
    key = hashlib.sha256(f"{torch.__version__}|{sys.version}|{compiler}|{stamp}".encode()).hexdigest()[:16]
    return cache_folder() / "compiler-probe" / f"inductor-{key}.ok"


def probe_once(backend: CompilerBackend) -> str | None:
    """`_probe`, skipped when an earlier process on this machine saw Inductor work with the
    same torch, Python and compiler (see the module docstring)."""
    marker = _probe_marker() if backend == "inductor" else None
    if marker is not None and marker.is_file():
        return None
    reason = _probe(backend)
    if reason is None and marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass  # a read-only cache folder: probe again next time
    return reason


def repeated_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of identical layers: the longest ModuleList of one module type."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > (len(best) if best is not None else 1):
            if len({type(child) for child in module}) == 1:
                best = module
    return best


def regions(model: nn.Module) -> list[nn.Module]:
    """What to compile: each repeated layer plus the leaf modules outside them that do
    the heavy work (the output head), which then share one compiled graph per kind."""
    blocks = repeated_layers(model)
    if blocks is None:
        return [model]
    inside = {id(m) for block in blocks for m in block.modules()}
    # linear layers outside the stack (nn.Linear or a quantized one): the output head
    heads = [m for m in model.modules() if id(m) not in inside and hasattr(m, "out_features")]
    return [*blocks, *heads]


def compile_decoder(model: nn.Module, *, backend: CompilerBackend = "inductor") -> CompileReport:
    """Compile `model`'s repeated layers and output head in place (see the module
    docstring); or leave it eager when `backend` does not work here."""
    reason = probe_once(backend)
    if reason is not None:
        return CompileReport(compiled=False, backend=_name(backend), reason=reason)
    chosen = regions(model)
    _quiet_cache_damage()
    fallback = _EagerFallback(chosen)
    for region in chosen:
        region.compile(backend=backend)
        region._compiled_call_impl = fallback.guard(region, region._compiled_call_impl)
    return CompileReport(compiled=True, backend=_name(backend), regions=len(chosen))


def _inductor_cache() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return str(cache_dir())
    except Exception:  # noqa: BLE001 - a torch without it
        return "Inductor's cache folder"


class _EagerFallback:
    """Turns every region of one model eager when a compiled call fails (module docstring)."""

    def __init__(self, chosen: list[nn.Module]) -> None:
        self.regions = chosen
        self.lock = threading.Lock()
        self.said = False

    def guard(self, region: nn.Module, compiled: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return compiled(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any compile failure: run eagerly
                self.fall_back(error)
                return region._call_impl(*args, **kwargs)

        return call

    def fall_back(self, error: BaseException) -> None:
        with self.lock:
            for region in self.regions:
                region._compiled_call_impl = None
            if not self.said:
                self.said = True
                print(f"qkv: compiling failed ({_describe(error)[:200]}); running eagerly. If this repeats, "
                      f"remove the Inductor cache at {_inductor_cache()}", file=sys.stderr, flush=True)


class _CacheDamage(logging.Filter):
    """Inductor's "unable to load compiled graph" warning (with its traceback) as one line."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.exc_info:
            return True
        if not _CacheDamage.said:
            _CacheDamage.said = True
            error = record.exc_info[1]
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
            print(f"qkv: an entry of Inductor's cache at {_inductor_cache()} is damaged ({reason}); compiling it "
                  "again", file=sys.stderr, flush=True)
        return False


def _drop_half_read_graphs(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    def unraisable(info: Any) -> None:
        # A graph whose pickle was cut short fails in __del__ for a field it never got.
        where = getattr(info.object, "__qualname__", "")
        if where == "CompiledFxGraph.__del__" and isinstance(info.exc_value, AttributeError):
            return
        hook(info)

    return unraisable


@functools.lru_cache(maxsize=1)
def _quiet_cache_damage() -> None:
    """Install the one-line report of damaged Inductor cache entries (module docstring), once."""
    logging.getLogger("torch._inductor.codecache").addFilter(_CacheDamage())
    sys.unraisablehook = _drop_half_read_graphs(sys.unraisablehook)


def eager_prompts() -> contextlib.AbstractContextManager[object]:
    """Prompts run eagerly even on a compiled model (one shape family of graphs: the decode steps)."""
    if "torch._dynamo" not in sys.modules:  # nothing can be compiled; set_stance would import Dynamo (1.6 s)
        return contextlib.nullcontext()
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
