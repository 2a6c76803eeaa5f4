"""Speed: measure the limits, transform models to approach them, compare with peers.

- bandwidth: measured memory read bandwidth (the decode roofline's numerator);
- roofline: bytes read per generated token and the tokens/s they allow;
- linear: `DecodeLinear` and weight-only `Int8Linear`, swapped into a model in place
  (`use_decode_linears`, `quantize_int8`);
- compile: `compile_decoder`, torch.compile with a clean fall back to eager;
- prepare: `prepare_for_decoding`, the one switch the commands use, and `warm_up`;
- timing: alternating contenders, medians, ratios from the same run;
- bench: the sections of `qkv bench` (needs transformers).

Shape legend: see each module.
"""

from qkv.perf.bandwidth import Bandwidth, measure_read_bandwidth
from qkv.perf.compile import CompileState, compile_decoder
from qkv.perf.prepare import QUANTIZATIONS, prepare_for_decoding, warm_up
from qkv.perf.linear import DecodeLinear, Int8Linear, quantize_int8, quantize_rows, use_decode_linears
from qkv.perf.roofline import TokenBytes, kv_bytes_per_token, roofline_tokens_per_s, token_bytes, weight_bytes_per_token
from qkv.perf.timing import Measurement, Ratio, alternate, ratio

__all__ = [
    "QUANTIZATIONS", "Bandwidth", "CompileState", "DecodeLinear", "Int8Linear", "Measurement", "Ratio", "TokenBytes",
    "alternate", "compile_decoder", "kv_bytes_per_token", "measure_read_bandwidth", "quantize_int8",
    "prepare_for_decoding", "quantize_rows", "ratio", "roofline_tokens_per_s", "token_bytes", "use_decode_linears",
    "warm_up", "weight_bytes_per_token",
]
