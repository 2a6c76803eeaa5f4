"""What the server serves: one model with its tokenizer, chat template, end tokens and the engine
that decodes it. The HTTP app and the explorer both read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from qkv.chat.conversation import ChatTemplate
from qkv.serve.engine.batching import Engine


@dataclass
class Served:
    """What the server serves: one model, its tokenizer, chat template and end tokens."""

    name: str
    model: Any  # CausalDecoder
    tokenizer: Any  # tokenizers.Tokenizer
    template: ChatTemplate | None
    stop_ids: frozenset[int]
    engine: Engine
    created: int = field(default_factory=lambda: int(time.time()))
