"""What every section shares: sizes, options, the section record, the run's context
(the random GPT-2 checkpoint, built once), optional contenders, machine facts.

Shape legend: B batch (1 here), T prompt tokens, N new tokens, L context length.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from qkv.bench.measure.timing import Measurement, Ratio


@dataclass(frozen=True)
class Sizes:
    """Model and workload sizes; FULL is what the issue's targets name, QUICK a smoke test."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    n_positions: int
    prompt: int
    new_tokens: int
    prefill: int
    cache_model: tuple[int, int, int, int]  # n_layer, n_embd, n_head, vocab of the small GPT
    cache_prompt: int
    cache_new: int
    attention_tokens: int
    plot_lengths: tuple[int, ...]
    bandwidth_bytes: int
    quality_tokens: int  # tokens of --data scored (0: all)
    smollm2_prompt: int
    smollm2_new: int
    quality_model: str  # "smollm2", or "gpt2": the run's random GPT-2 checkpoint


FULL = Sizes(12, 768, 12, 50257, 1024, 64, 128, 1024, (4, 256, 4, 8192), 16, 512, 1024,
             (64, 128, 256, 512, 1020), 512 * 2**20, 0, 32, 128, "smollm2")
QUICK = Sizes(2, 32, 2, 128, 64, 4, 6, 16, (2, 32, 2, 128), 4, 12, 32, (4, 8), 8 * 2**20, 64, 8, 4, "gpt2")


@dataclass
class Section:
    name: str
    measurements: list[Measurement] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # derived numbers, notes
    skipped: list[str] = field(default_factory=list)  # one line per contender or part left out

    def to_dict(self) -> dict[str, Any]:
        return {
            "measurements": [m.to_dict() for m in self.measurements],
            "ratios": [r.to_dict() for r in self.ratios],
            "facts": self.facts,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class Options:
    sizes: Sizes
    repeats: int = 5
    threads: int = 2
    data: Path | None = None  # the text the quality section scores
    plot_path: Path | None = None
    progress: Callable[[str], None] = lambda message: None


@dataclass
class Context:
    """One run's shared state: options, a temporary folder, what one section leaves for
    another (the decode section's contenders for the roofline)."""

    options: Options
    folder: Path
    shared: dict[str, Any] = field(default_factory=dict)

    @property
    def sizes(self) -> Sizes:
        return self.options.sizes

    def progress(self, message: str) -> None:
        self.options.progress(message)

    def gpt2_checkpoint(self) -> Path:
        """The random GPT-2-shaped checkpoint at the run's sizes (built on first use)."""
        if "gpt2" not in self.shared:
            from qkv.bench.gpt2_checkpoint import make_gpt2_checkpoint

            s = self.sizes
            self.progress("building the random GPT-2 checkpoint")
            self.shared["gpt2"] = make_gpt2_checkpoint(self.folder / "gpt2", s.n_layer, s.n_embd, s.n_head,
                                                       s.vocab, s.n_positions)
        return self.shared["gpt2"]  # type: ignore[no-any-return]


def optional(module: str, why: str) -> ModuleType | str:
    """The module, or a one-line message saying it is skipped and why."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        return f"{why}: skipped ({module} is not importable: {error})"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> dict[str, Any]:
    model_name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": model_name, "logical cpus": os.cpu_count(), "torch threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "load average (1, 5, 15 min)": [round(x, 2) for x in os.getloadavg()],
    }
    for name in ("transformers", "llama_cpp"):
        module = optional(name, name)
        if not isinstance(module, str):
            info[name] = getattr(module, "__version__", "?")
    return info
