"""Fixtures for the training tests: real text, one torch thread, a small fast run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VERDICT = Path(__file__).resolve().parents[3] / "shared" / "data" / "the-verdict.txt"


@pytest.fixture(scope="session")
def verdict_text() -> str:
    """The book's short story (CI keeps it at ../shared/data relative to the repo root)."""
    assert VERDICT.is_file(), f"the test data {VERDICT} is missing"
    return VERDICT.read_text(encoding="utf-8")


@pytest.fixture
def story_file(tmp_path: Path, verdict_text: str) -> Path:
    """The first third of the story: enough windows for short runs, quick to tokenize."""
    path = tmp_path / "story.txt"
    path.write_text(verdict_text[:7000], encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """Training tests run beside others on 2 cores; one thread avoids oversubscription."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
