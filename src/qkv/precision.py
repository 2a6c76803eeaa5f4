"""The precisions qkv decodes in, and the default, in a module that imports no torch (so
`qkv --help` can name them without loading PyTorch). What each one does:
`qkv.perf.prepare`.

DEFAULT_PRECISION is int8. On SmolLM2 (benchmarks/RESULTS.md, a loaded 2-core AVX2 machine)
int8 and int4 decoded equally fast in the best rounds (about 30 ms a token, against 34 for
bfloat16 and 54 for float32, all compiled), and int8 costs +0.7% perplexity against
bfloat16 (int4: 0.0%, because that file's Q4_1 weights are exactly representable). int8
is the default because its cost does not depend on how the checkpoint was made: int4's
was measured only on a checkpoint that was already 4-bit.
"""

PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4")
QUANTIZED: tuple[str, ...] = ("int8", "int4")
DEFAULT_PRECISION = "int8"
