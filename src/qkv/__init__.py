"""qkv: attention built from its smallest part, the key, up to real language models.

Shape legend used across the package: B batch, T query tokens, S key tokens (cache
included), C embedding, H query heads, H_kv key/value heads, D head size, V vocabulary.
"""

from qkv.errors import QkvError

__all__ = ["QkvError"]
__version__ = "0.1.0"
