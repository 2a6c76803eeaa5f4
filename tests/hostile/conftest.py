"""`kill20` tests (the full kill -9 run) are deselected unless asked for:
pytest -m kill20 tests/hostile. (Deselected, not skipped: a default run reports no skips.)"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "kill20" in (config.getoption("-m") or ""):
        return
    chosen = [item for item in items if "kill20" not in item.keywords]
    if len(chosen) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if "kill20" in item.keywords])
        items[:] = chosen
