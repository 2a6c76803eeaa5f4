"""Run the chosen sections in order with one shared context (a temporary folder that
holds the random GPT-2 checkpoint, built once), yielding each section as it finishes."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

from qkv.bench import section_function
from qkv.bench.common import Context, Options, Section


def run_sections(names: list[str], options: Options) -> Iterator[Section]:
    with tempfile.TemporaryDirectory(prefix="qkv-bench-") as tmp:
        ctx = Context(options, Path(tmp))
        for name in names:
            options.progress(name)
            yield section_function(name)(ctx)
