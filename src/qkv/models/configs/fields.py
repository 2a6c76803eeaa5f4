"""Typed reads of config.json values: each one checked for type and range, or a ValueError
that names the key and the value found.

config.json comes from anywhere; `int(config["n_layer"])` would accept "12", 12.7 and
True, and crash on "abc" or a list. These readers accept exactly what the key means.
"""

from __future__ import annotations

import math
from typing import Any

MISSING: Any = object()
# Ceilings no real decoder comes near (the largest have ~130 layers and ~256k-token
# vocabularies); they keep a few bytes of config from asking for absurd structures.
MAX_LAYERS = 1024
MAX_DIM = 2**20
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**24


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int = MAX_DIM) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {_shown(value)}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be between {minimum} and {maximum:,}, got {_shown(value)}")
    return value


def check_float(
    name: str, value: Any, *, minimum: float = -math.inf, maximum: float = math.inf, positive: bool = False
) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{name} must be a number, got {_shown(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {_shown(value)}")
    if positive and not number > 0:
        raise ValueError(f"{name} must be positive, got {_shown(value)}")
    if not minimum <= number <= maximum:
        raise ValueError(f"{name} must be between {minimum} and {maximum}, got {_shown(value)}")
    return number


def get_int(config: dict[str, Any], key: str, default: Any = MISSING, **bounds: Any) -> Any:
    value = config.get(key, default)
    if value is MISSING:
        raise ValueError(f"config.json lacks {key}")
    return value if value is None and default is None else check_int(key, value, **bounds)


def get_float(config: dict[str, Any], key: str, default: Any = MISSING, **bounds: Any) -> float:
    value = config.get(key, default)
    if value is MISSING:
        raise ValueError(f"config.json lacks {key}")
    return check_float(key, value, **bounds)


def get_bool(config: dict[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {_shown(value)}")
    return value


def get_str(config: dict[str, Any], key: str, default: str) -> str:
    value = config.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {_shown(value)}")
    return value


def get_dict(config: dict[str, Any], key: str) -> dict[str, Any]:
    """An optional object (null and absent read as {})."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object, got {_shown(value)}")
    return value
