"""qkv: attention built from its smallest part, the key, up to real language models.

Shape legend used across the package: B batch, T query tokens, S key tokens (cache
included), C embedding, H query heads, H_kv key/value heads, D head size, V vocabulary.
"""

from typing import Any

from qkv.errors import QkvError
from qkv.util import moved

moved.install()  # the old import paths of 0.1 still work for one release, with a warning

# Heavier entry points, imported on first use so `import qkv` stays cheap.
_LAZY = {
    "load_pretrained": "qkv.models.loader",
    "save_pretrained": "qkv.models.hf.checkpoint",
    "trace": "qkv.trace",
    "generate": "qkv.generation",
    "load_for_generation": "qkv.runtime.prepare",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed package's metadata: one source, pyproject.toml
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("qkv")
        except PackageNotFoundError:
            return "unknown (not installed)"
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


__all__ = ["QkvError", *_LAZY]
