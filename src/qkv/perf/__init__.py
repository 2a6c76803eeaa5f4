"""Speed tools the runtime (qkv.runtime) uses: weight formats, compilation, measurements.

- quantize: weight-only `Int8Linear` (per row) and `Int4Linear` (per group), swapped
  into a model in place (`quantize`);
- compile: `compile_decoder`, regional `nn.Module.compile` with a probe that keeps the
  model eager (and says why) where no compiler works;
- bandwidth: measured memory read bandwidth (the decode roofline's numerator);
- roofline: bytes read per generated token and the tokens/s they allow;
- timing: alternating contenders, medians, ratios from the same run.

Shape legend: see each module.
"""

from qkv.perf.bandwidth import Bandwidth, measure_read_bandwidth
from qkv.perf.compile import CompileReport, compile_decoder
from qkv.perf.quantize import QUANTIZATIONS, Int4Linear, Int8Linear, quantize, quantize_blocks, quantize_rows
from qkv.perf.roofline import TokenBytes, kv_bytes_per_token, roofline_tokens_per_s, token_bytes, weight_bytes_per_token
from qkv.perf.timing import Measurement, Probed, Ratio, alternate, alternate_probed, ratio

__all__ = [
    "QUANTIZATIONS", "Bandwidth", "CompileReport", "Int4Linear",
    "Int8Linear", "Measurement", "Probed", "Ratio", "TokenBytes", "alternate", "alternate_probed", "compile_decoder",
    "kv_bytes_per_token",
    "measure_read_bandwidth", "quantize",
    "quantize_blocks", "quantize_rows", "ratio", "roofline_tokens_per_s", "token_bytes", "weight_bytes_per_token",
]
