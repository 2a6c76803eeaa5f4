"""Speed: transform models for decoding, measure the limits, time contenders.

- quantize: weight-only `Int8Linear` (per row) and `Int4Linear` (per group), swapped
  into a model in place (`quantize`);
- compile: `compile_decoder`, regional `nn.Module.compile` with a probe that keeps the
  model eager (and says why) where no compiler works;
- prepare: `prepare_for_decoding` and `load_for_generation`, the one switch every command
  and the Python API use (precision, compilation);
- bandwidth: measured memory read bandwidth (the decode roofline's numerator);
- roofline: bytes read per generated token and the tokens/s they allow;
- timing: alternating contenders, medians, ratios from the same run.

Shape legend: see each module.
"""

from qkv.perf.bandwidth import Bandwidth, measure_read_bandwidth
from qkv.perf.compile import CompileReport, compile_decoder
from qkv.perf.prepare import (
    DEFAULT_PRECISION, PRECISIONS, DecodeSetup, load_dtype, load_for_generation, prepare_for_decoding,
)
from qkv.perf.quantize import QUANTIZATIONS, Int4Linear, Int8Linear, quantize, quantize_blocks, quantize_rows
from qkv.perf.roofline import TokenBytes, kv_bytes_per_token, roofline_tokens_per_s, token_bytes, weight_bytes_per_token
from qkv.perf.timing import Measurement, Probed, Ratio, alternate, alternate_probed, ratio

__all__ = [
    "DEFAULT_PRECISION", "PRECISIONS", "QUANTIZATIONS", "Bandwidth", "CompileReport", "DecodeSetup", "Int4Linear",
    "Int8Linear", "Measurement", "Probed", "Ratio", "TokenBytes", "alternate", "alternate_probed", "compile_decoder",
    "kv_bytes_per_token",
    "load_dtype", "load_for_generation", "measure_read_bandwidth", "prepare_for_decoding", "quantize",
    "quantize_blocks", "quantize_rows", "ratio", "roofline_tokens_per_s", "token_bytes", "weight_bytes_per_token",
]
