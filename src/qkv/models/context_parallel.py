"""A whole decoder run context-parallel: each of N processes holds a shard of the sequence.

Everything in a decoder but attention works token by token (embeddings, norms, MLPs, the
output head), so a rank that is given its shard of the tokens and their *global* positions
(RoPE and learned position embeddings both read them) computes exactly its rows of the
single-process logits, provided its attention layers see every rank's keys and values:
that is ring attention (`qkv.attention.ring`).

Design: a model runs context-parallel while a `Ring` is attached to each of its attention
layers as the attribute `ring`, the way a KV cache is attached as `kv_cache`. `attach_ring`
is the one place that sets and clears it (a context manager), and `sharded_forward` shards
a batch, attaches the ring for one forward pass and returns this rank's logits with their
positions. No method is replaced and nothing global changes: outside the `with` block the
model is the plain model. The backward pass needs no attachment: the autograd function
keeps its ring.

Shape legend: B batch, S tokens of the whole sequence, T this rank's tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor

from qkv.attention.ring import DEFAULT_TIMEOUT, Ring, Sharding, ring_for
from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder


@dataclass(frozen=True)
class ContextParallel:
    """How sequences are sharded: the process group of the ring (None = one process), the
    sharding of each sequence, and how long any wait on a neighbour may take."""

    group: dist.ProcessGroup | None = None
    sharding: Sharding = "zigzag"
    timeout: timedelta = DEFAULT_TIMEOUT

    def ring(self, seq_len: int) -> Ring:
        return ring_for(seq_len, group=self.group, sharding=self.sharding, timeout=self.timeout)

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)


def join_context_parallel(
    *, expected_world_size: int | None = None, sharding: Sharding = "zigzag",
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> ContextParallel:
    """Every process of the initialised default group in one ring (its own group, so its
    sends and receives never interleave with other collectives). Call it on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise QkvError(
            "context parallelism needs a torch.distributed process group: run under "
            "`torchrun --nproc_per_node N` (or call torch.distributed.init_process_group first)"
        )
    n = dist.get_world_size()
    if expected_world_size is not None and expected_world_size != n:
        raise QkvError(
            f"mismatched world sizes: asked for {expected_world_size} context-parallel processes "
            f"but {n} were started (torchrun --nproc_per_node {expected_world_size})"
        )
    group = dist.new_group(timeout=timeout) if n > 1 else None
    return ContextParallel(group, sharding, timeout)


@contextmanager
def attach_ring(model: CausalDecoder, ring: Ring) -> Iterator[CausalDecoder]:
    """Within the block, every attention layer of `model` attends through `ring`."""
    layers = list(model.attention_layers())
    for layer in layers:
        layer.ring = ring
    try:
        yield model
    finally:
        for layer in layers:
            layer.ring = None


@dataclass(frozen=True)
class ShardedOutput:
    logits: Tensor  # (B, T, V): this rank's rows of the whole sequence's logits
    positions: Tensor  # (T,): their global positions
    ring: Ring


def sharded_forward(model: CausalDecoder, input_ids: Tensor, cp: ContextParallel) -> ShardedOutput:
    """This rank's logits for the whole sequence `input_ids` (B, S), which every rank holds."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
    seq_len = input_ids.shape[1]
    if seq_len > model.context_length:
        raise QkvError(f"{seq_len} tokens exceed the model's context length ({model.context_length})")
    ring = cp.ring(seq_len)
    positions = ring.layout.positions(ring.rank, device=input_ids.device)  # (T,)
    local_ids = ring.layout.shard(input_ids, ring.rank, dim=1)  # (B, T)
    with attach_ring(model, ring):
        logits = model(local_ids, positions=positions)  # (B, T, V)
    return ShardedOutput(logits, positions, ring)
