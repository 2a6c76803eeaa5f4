"""The runtime: the one owner of preparing a model for decoding and of its decode steps.

- `prepare`: `prepare.prepare(source, precision)`, the one way a file or folder becomes a decodable
  model (`PreparedModel`: the model and how it was prepared) for every command, the server
  and `load_for_generation`; `prepare_for_decoding` brings a model already in memory to a
  precision. How a model was prepared is the `DecodeSetup` they return, handed on as a value;
- `session`: `DecodeSession`, one request, a batch of rows or a server's slots: it owns its
  KV caches and chooses how its steps run (native layers, compiled or plain modules);
- `layer_step`: a decode step as one call of qkv's C++: every layer and the head.

Models are pure (qkv.models): they hold weights, never caches or fast paths. Generation
(qkv.generation), the server, the explorer, benchmarks and the CLI decode through here.
"""

from qkv.runtime.prepare import (
    DecodeSetup, PreparedModel, load_dtype, load_for_generation, prepare_for_decoding,
)
from qkv.runtime.prompt_parts import aligned_parts, reusable_prefix
from qkv.runtime.session import STEPS, DecodeSession, cache_capacity

__all__ = [
    "STEPS", "DecodeSession", "DecodeSetup", "PreparedModel", "aligned_parts", "cache_capacity", "load_dtype",
    "load_for_generation", "prepare_for_decoding", "reusable_prefix",
]
