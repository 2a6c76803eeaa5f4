"""GGUF files (llama.cpp's format): the bounded header reader, architectures, config from
metadata, block dequantizers (32-weight blocks and K-quants), stored blocks, the file's tokenizer."""

from typing import Any

# The names most callers want, as `from qkv.models.gguf import read_gguf` (imported on first use:
# the submodules import this package, so it imports none of them at load).
_CHECKPOINT = ("GGUFCheckpoint", "GGUFFile", "is_gguf_file", "open_gguf_file", "read_gguf", "resolve_gguf")


def __getattr__(name: str) -> Any:
    if name in _CHECKPOINT:
        from qkv.models.gguf import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'qkv.models.gguf' has no attribute {name!r}")
