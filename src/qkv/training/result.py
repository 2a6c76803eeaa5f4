"""What a training run hands back, of either kind (the loop's own run or the book's): its
folder, the last step, tokens seen, the evaluation records and the wall time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class TrainResult:
    out: Path
    step: int
    tokens_seen: int
    records: list[dict[str, Any]]
    seconds: float
