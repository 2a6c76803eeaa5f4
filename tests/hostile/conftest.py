"""`kill20` tests (the full kill -9 run) only run when asked for: pytest -m kill20 tests/hostile."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "kill20" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the full 20-kill run: pytest -m kill20 tests/hostile")
    for item in items:
        if "kill20" in item.keywords:
            item.add_marker(skip)
