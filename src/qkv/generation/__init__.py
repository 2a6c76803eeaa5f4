"""Text generation: one decode loop, built from small steps, that every command shares.

- `sampling`: `Sampling` (temperature, top-k, top-p, seed; checked once) and `sample`;
- `session`: `DecodeSession`, the owner of a model's KV caches while it generates
  (prefill, one decode step, positions carried as tensors);
- `loop`: `continue_from` (sample, stop, decode, repeat), `stream` and `generate`.

Every model step runs under torch.inference_mode(); sampling draws from its own
torch.Generator, never the global RNG.
"""

from qkv.generation.loop import check_request, continue_from, generate, stop_tokens, stream
from qkv.generation.sampling import Sampling, sample
from qkv.generation.session import DecodeSession, cache_capacity, warm_up

__all__ = [
    "DecodeSession", "Sampling", "cache_capacity", "check_request", "continue_from", "generate", "sample",
    "stop_tokens", "stream", "warm_up",
]
