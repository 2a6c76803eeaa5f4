"""One checkpoint tensor's way into a model: its name, the shape the config implies, and
the function that turns it into one or more model tensors (qkv.models.key_maps.hf checks a
whole checkpoint against a list of them before taking anything in)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class KeyMap:
    hf_name: str
    shape: tuple[int, ...]
    to_model: Callable[[Tensor], dict[str, Tensor]]
