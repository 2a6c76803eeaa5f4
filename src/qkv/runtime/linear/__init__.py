"""The linear layer kinds a prepared decoder runs on, owned by the runtime: int8 per row and int4
per group (quantized), a GGUF matrix kept in its stored blocks (block), float32 on qkv's kernel
(float), float stored input-major (transposed).

Shape legend: see each module.
"""

from qkv.runtime.linear.quantized import QUANTIZATIONS, Int4Linear, Int8Linear, quantize, quantize_groups, quantize_rows

__all__ = ["QUANTIZATIONS", "Int4Linear", "Int8Linear", "quantize", "quantize_groups", "quantize_rows"]
