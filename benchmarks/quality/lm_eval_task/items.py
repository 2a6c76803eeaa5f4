"""lm-evaluation-harness's loader for verdict_next.jsonl (next to this file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(**_: Any) -> dict[str, Any]:
    import datasets

    path = Path(__file__).with_name("verdict_next.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
