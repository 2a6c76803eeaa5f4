"""One switch for the decode speed-ups, shared by `qkv generate`, `qkv chat` and `qkv bench`.

    prepare_for_decoding(model, *, compile=False, quantize=None) -> the same model, changed in place

- default: `DecodeLinear` with column-major weights, the layout PyTorch's eager CPU
  matrix-vector product reads fastest (GPT-2-124M shape, 2 cores: 1.18x transformers'
  decode speed in float32, against 0.92x for the weights as loaded);
- compile=True: `compile_decoder` (row-major multiply-and-reduce linears, Inductor):
  about twice as fast again after a compile of 10-20 s (one layer, reused by all of
  them); falls back to eager, with one warning, where no C++ compiler works;
- quantize="int8": weight-only `Int8Linear` layers, a quarter of float32's bytes per
  token; the quality cost is measured by `qkv bench --quantize int8`.

All of them give the model's own tokens up to float rounding (tests/perf).

`warm_up(model)` runs the compilation before a timed or interactive generation, so that
the first token a user waits for, or a tokens/s figure, does not include it.
"""

from __future__ import annotations

import time

import torch

from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder
from qkv.perf.compile import compile_decoder
from qkv.perf.linear import quantize_int8, use_decode_linears

QUANTIZATIONS: tuple[str, ...] = ("int8",)


def prepare_for_decoding(
    model: CausalDecoder, *, compile: bool = False, quantize: str | None = None
) -> CausalDecoder:
    """Apply the chosen speed-ups to `model` in place (see the module docstring)."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise QkvError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantize == "int8":
        quantize_int8(model)
    if compile:
        compile_decoder(model)
    elif quantize is None:
        use_decode_linears(model)
    return model


def warm_up(model: CausalDecoder, *, batch_size: int = 1, max_seq_len: int = 8) -> float:
    """Run two decode steps on a throw-away cache (compiling them, if the model is
    compiled, for caches of up to `max_seq_len` positions). Returns the seconds taken."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    model.setup_cache(batch_size, max(2, max_seq_len))
    try:
        with torch.inference_mode():
            token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
            model(token)
            model(token)
    finally:
        model.remove_cache()
        model.train(was_training)
    return time.perf_counter() - start
