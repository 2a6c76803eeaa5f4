"""qkv's own CPU kernels for weight-only decoding: int8 and 4-bit matrix products that read
each weight once, built for this machine on first use.

    status = native_kernels()      # builds or loads once per process; never raises
    status.available, status.describe()

At batch 1 a decode step streams every weight of the model from memory once, so its speed
is the weight bytes over the memory bandwidth. PyTorch's CPU kernels for this
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) reach 5-9 GB/s here on SmolLM2's
layers, against about 30 GB/s of read bandwidth; `kernels.cpp` reaches 11-23 GB/s for int8,
9-12 for int4 and 17-23 for float32, mostly by prefetching the next rows while it computes
(benchmarks/RESULTS.md, `benchmarks/kernels.py`). The source ships with qkv and is compiled by the machine's C++
compiler against PyTorch's stable C ABI (headers only: about 3 seconds), into a per-user
cache folder keyed by the source, the compiler and the torch version, so it is built once
per machine. The ops are `torch.ops.qkv.int8_linear`, `int4_linear`, `f32_linear`,
`decode_attention` and `decoder_layer` (a whole layer's decode step, qkv.runtime.native_layers);
they have fake implementations, so torch.compile traces them as one opaque call each.

They need an x86-64 CPU with AVX2, FMA and F16C, PyTorch 2.10 or later (the stable ABI),
and a C++ compiler (`$CXX`, `c++` or `g++`); where the CPU also has AVX-512 VNNI the int4
product uses it (`QKV_NATIVE_ISA=avx2` builds without it, qkv.native.build). Where any is
missing, or with `QKV_NATIVE=0`, `native_kernels()` says why and the quantized layers use PyTorch's kernels: the same
weights, more slowly.
"""

from qkv.native.build import NativeStatus, native_kernels

__all__ = ["NativeStatus", "native_kernels"]
