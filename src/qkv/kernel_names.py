"""The names of qkv's attention kernels, torch-free so that configs (and every `--help`
that reads them) can check a name without importing torch. The kernels themselves are in
qkv.attention.kernels: "explicit" spells out scores, mask and softmax; "fused" calls
PyTorch's scaled_dot_product_attention.
"""

from typing import Literal

Backend = Literal["explicit", "fused"]
BACKENDS: tuple[str, ...] = ("explicit", "fused")
