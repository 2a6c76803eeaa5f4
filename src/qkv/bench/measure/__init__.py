"""Measurement: alternating contenders with medians and ratios from the same run (timing), memory
read bandwidth (bandwidth), and the decode roofline (roofline).

Shape legend: see each module.
"""

from qkv.bench.measure.bandwidth import Bandwidth, measure_read_bandwidth
from qkv.bench.measure.roofline import TokenBytes, kv_bytes_per_token, roofline_tokens_per_s, token_bytes, weight_bytes_per_token
from qkv.bench.measure.timing import Measurement, Probed, Ratio, alternate, alternate_probed, ratio

__all__ = [
    "Bandwidth", "Measurement", "Probed", "Ratio", "TokenBytes", "alternate", "alternate_probed", "kv_bytes_per_token",
    "measure_read_bandwidth", "ratio", "roofline_tokens_per_s", "token_bytes", "weight_bytes_per_token",
]
