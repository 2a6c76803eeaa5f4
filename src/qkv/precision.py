"""The precisions qkv decodes in, and the default, in a module that imports no torch (so
`qkv --help` can name them without loading PyTorch). What each one does:
`qkv.perf.prepare`.

DEFAULT_PRECISION is the fastest precision whose perplexity on the-verdict stays within 1%
of bfloat16's, as measured by `qkv bench --only quality,smollm2` on the machines
benchmarks/RESULTS.md names.
"""

PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4")
QUANTIZED: tuple[str, ...] = ("int8", "int4")
DEFAULT_PRECISION = "int8"
