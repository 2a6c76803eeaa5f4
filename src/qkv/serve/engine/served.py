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
    precision: str = "float32"  # what the weights are multiplied in, resolved ("auto" never stays)
    kernels: str = "PyTorch's kernels"  # what runs the products (qkv.runtime.native's describe())
    path: str = ""  # the file or folder loaded, as the loader found it

    @property
    def max_model_len(self) -> int:
        """The most positions one request may use, prompt and answer: --context, at most the
        model's context length (the engine's limit, not its cache's rounded-up capacity)."""
        return self.engine.context

    def card(self) -> dict[str, object]:
        """What the server says about how it runs the model (/v1/models' "qkv" field)."""
        return {"precision": self.precision, "kernels": self.kernels, "max_model_len": self.max_model_len,
                "context_length": int(self.model.context_length), "path": self.path}
