"""The runtime: the one owner of preparing a model for decoding and of its decode steps.

- `prepare`: `prepare_for_decoding` (precision, kernels, compilation) and the loaders built
  on it (`load_for_generation`, `load_prepared_model`); `setup_of(model)` says how a model
  was prepared;
- `session`: `DecodeSession`, one request, a batch of rows or a server's slots: it owns its
  KV caches and chooses how its steps run (native layers, compiled or plain modules);
- `layer_step`: a decode step as one call of qkv's C++: every layer and the head.

Models are pure (qkv.models): they hold weights, never caches or fast paths. Generation
(qkv.generation), the server, the explorer, benchmarks and the CLI decode through here.
"""

from qkv.runtime.prepare import (
    DecodeSetup, load_dtype, load_for_generation, load_prepared_model, prepare_for_decoding, setup_of,
)
from qkv.runtime.session import STEPS, DecodeSession, aligned_parts, cache_capacity, reusable_prefix

__all__ = [
    "STEPS", "DecodeSession", "DecodeSetup", "aligned_parts", "cache_capacity", "load_dtype", "load_for_generation",
    "load_prepared_model", "prepare_for_decoding", "reusable_prefix", "setup_of",
]
