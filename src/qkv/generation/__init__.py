"""Text generation: one decode loop on the runtime's sessions (qkv.runtime), that every command shares.

- `sampling`: `Sampling` (temperature, top-k, top-p, seed; checked once) and `sample`;
- `loop`: `continue_from` (sample, stop, decode, repeat), `stream`, `generate` and `joined`;
- `detokenize`: `TextStream`, the one incremental detokenizer (ids -> text, stop strings).

Every model step runs under torch.inference_mode(); sampling draws from its own
torch.Generator, never the global RNG.
"""

from qkv.generation.loop import check_request, continue_from, generate, joined, stop_tokens, stream, warm_up
from qkv.generation.sampling import Sampling, sample

__all__ = [
    "Sampling", "check_request", "continue_from", "generate", "joined", "sample", "stop_tokens", "stream", "warm_up",
]
