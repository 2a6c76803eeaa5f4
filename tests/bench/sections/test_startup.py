"""The startup section times real processes: `qkv --help` runs and is measured."""

from __future__ import annotations

from pathlib import Path

from qkv.bench.sections import startup
from qkv.bench.common import QUICK, Context, Options


def test_wall_times_of_help(tmp_path: Path) -> None:
    samples = startup.wall_times([*startup.qkv_command(), "--help"], 2)
    assert len(samples) == 2 and all(s > 0 for s in samples)


def test_startup_section_end_to_end(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(startup, "SUBCOMMANDS", {"bench": "", "perplexity": ""})
    section = startup.startup_section(Context(Options(QUICK, repeats=1), tmp_path))
    names = [m.name for m in section.measurements]
    assert names == ["qkv --help", "qkv bench --help", "qkv perplexity --help", "qkv explain"]
    assert isinstance(section.facts["every --help under 0.5 s"], bool)
