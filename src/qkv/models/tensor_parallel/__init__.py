"""Tensor parallelism: a decoder split by key/value heads across torch.distributed ranks.

    assignment  which rank holds which KV heads, query heads, features, vocabulary rows
    group       the process group, bounded collectives, the same-file and seed checks
    slices      a rank's slice of a tensor read straight from a GGUF file or safetensors
    decoder     a rank's `TensorParallelDecoder`: its slice plus the all-reduces and gather
    opened      a model opened for one rank, for the runtime to prepare (qkv.runtime.tensor_parallel)

docs/distributed.md says how to run it.
"""
