"""qkv's own CPU kernels for weight-only decoding: int8 and 4-bit matrix products that read
each weight once, built for this machine on first use.

    status = native_kernels()      # builds or loads once per process; never raises
    status.available, status.describe()

At batch 1 a decode step streams every weight of the model from memory once, so its speed
is the weight bytes over the memory bandwidth. PyTorch's CPU kernels for this
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) reach 5-9 GB/s here on SmolLM2's
layers, against about 30 GB/s of read bandwidth; qkv's products reach 11-23 GB/s for int8,
9-12 for int4 and 17-23 for float32, mostly by prefetching the next rows while they compute
(benchmarks/HISTORY.md, `benchmarks/kernels/kernels.py`). The sources ship with qkv (products.cpp,
products_x86.cpp, attention.cpp, layer.cpp, sharing kernels.h) and are compiled by the
machine's C++ compiler against PyTorch's stable C ABI (headers only), into a per-user cache
folder keyed by the sources, the compiler and the torch version, so they are built once per
machine. The ops are `torch.ops.qkv.int8_linear`, `int4_linear`, `f32_linear`,
`decode_attention`, `decoder_layer` (a whole layer's decode step executing a `LayerSpec`),
`stack_step` (every layer and the head of a session's model in one call, stack.cpp,
qkv.runtime.layer_step) and `block_linear` (products straight from GGUF's stored blocks,
block_products.cpp, qkv.runtime.native.block_ops) and `quantized_decode_attention`
(csrc/quantized_cache/attention.cpp: one query per row over the quantized KV cache's packed codes, which
qkv.attention.caches.quantized_cache calls); they have fake implementations, so torch.compile traces
them as one opaque call each.

Organised as ggml's CPU backend and torchao are: each op has a generic variant in plain C++
(the reference, and what runs on any x86-64 CPU) and vectorised ones with the same math
(AVX2 + FMA + F16C; AVX-512 VNNI for the int4 product), chosen at run time from cpuid, never
from the build machine's flags (`qkv.runtime.native.ops.variants`, `use_variant`). A library whose
self-test fails in any variant is never used, with one line saying why. They need Linux
x86-64, PyTorch 2.10 or later (the stable ABI) and a C++ compiler (`$CXX`, `c++` or `g++`);
where one is missing, or with `QKV_NATIVE=0`, `native_kernels()` says why and the quantized
layers run the same math in PyTorch (qkv.runtime.linear.quantized), more slowly.
"""

from qkv.runtime.native.build import NativeStatus, native_kernels

__all__ = ["NativeStatus", "native_kernels"]
