"""Which rank holds what under tensor parallelism over N ranks: whole key/value heads with the
query heads that share them, a stretch of the feed-forward features, a stretch of the vocabulary.

A rank holds whole KV heads so that its cache holds its own keys and its attention needs no
other rank's (distributed-llama's rule, and vLLM's for N <= H_kv): N must divide H_kv. The
query heads of KV head g are g*G .. g*G+G-1 (G = H / H_kv, as `GroupedQueryAttention.query_heads_of`
says), so the rank holding KV heads [a, b) holds query heads [a*G, b*G). The feed-forward
features are split at multiples of 256 where F allows (a K-quant super-block: then a column
slice of down_proj is whole blocks), else of 32 (every other block type, and int4's groups),
else evenly. The vocabulary is split in stretches of ceil(V / N) rows (the last may be short).

Nothing here starts a process: `qkv explain --keys --tensor-parallel N` reads the assignment
from a model's description alone.

Shape legend: H query heads, H_kv key/value heads, G query heads per KV head, D head size,
F feed-forward features, V vocabulary, N ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.errors import QkvError
from qkv.models.configs.decoder_spec import DecoderSpec

FEATURE_ALIGNMENTS = (256, 32)  # a K-quant super-block, then every other block (and int4 group)


@dataclass(frozen=True)
class RankShare:
    """What rank `rank` of `world` holds of every layer (the same in each) and of the vocabulary."""

    rank: int
    world: int
    kv_heads: range
    query_heads: range
    head_dim: int
    features: range  # of F: gate/up rows, down columns
    vocabulary: range  # embedding and output-head rows

    @property
    def query_rows(self) -> range:
        """Rows of q_proj (and columns of o_proj) this rank holds."""
        return range(self.query_heads.start * self.head_dim, self.query_heads.stop * self.head_dim)

    @property
    def kv_rows(self) -> range:
        """Rows of k_proj and v_proj this rank holds."""
        return range(self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim)


def working_sizes(kv_heads: int) -> list[int]:
    """Every N that divides `kv_heads`: the rank counts that hold whole KV heads."""
    return [n for n in range(1, kv_heads + 1) if kv_heads % n == 0]


def check_world(kv_heads: int, world: int, what: str) -> None:
    """QkvError unless `world` ranks can each hold whole KV heads of `kv_heads`."""
    if world < 1:
        raise QkvError(f"--tensor-parallel needs at least 1 rank, got {world}")
    if kv_heads % world:
        sizes = ", ".join(str(n) for n in working_sizes(kv_heads))
        heads = "1 key/value head" if kv_heads == 1 else f"{kv_heads} key/value heads"
        reason = ("it cannot be split: run it on one process" if kv_heads == 1
                  else f"choose --tensor-parallel {sizes}")
        raise QkvError(f"--tensor-parallel {world} does not divide {what}'s {heads} (each rank holds whole "
                       f"key/value heads with their query heads); {reason}")


def split(total: int, parts: int, alignment: int = 1) -> list[range]:
    """[0, total) in `parts` consecutive stretches as even as units of `alignment` allow."""
    units = total // alignment
    base, extra = divmod(units, parts)
    ranges, start = [], 0
    for index in range(parts):
        size = (base + (index < extra)) * alignment
        ranges.append(range(start, start + size))
        start += size
    return ranges


def feature_split(features: int, world: int) -> list[range]:
    """The feed-forward features per rank, at block boundaries where F allows (module docstring)."""
    for alignment in FEATURE_ALIGNMENTS:
        if features % alignment == 0 and features // alignment >= world:
            return split(features, world, alignment)
    return split(features, world)


def uniform_layers(spec: DecoderSpec, what: str) -> tuple[int, int, int, int]:
    """(H, H_kv, D, F), the same in every layer (else QkvError: ranks hold one share of each)."""
    shapes = {(l.attention.num_heads, l.attention.num_kv_heads, l.attention.head_dim, l.mlp.intermediate_size)
              for l in spec.layers}
    if len(shapes) != 1:
        raise QkvError(f"{what}'s layers differ in heads or feed-forward size; tensor parallelism splits "
                       "models whose layers all have the same shape")
    return shapes.pop()


def shares(spec: DecoderSpec, world: int, what: str = "the model") -> list[RankShare]:
    """Every rank's share of `spec` over `world` ranks (QkvError when N does not divide H_kv)."""
    heads, kv_heads, head_dim, features = uniform_layers(spec, what)
    check_world(kv_heads, world, what)
    group = heads // kv_heads
    per_rank = kv_heads // world
    stretch = -(-spec.vocab_size // world)
    ffn = feature_split(features, world)
    out = []
    for rank in range(world):
        kv = range(rank * per_rank, (rank + 1) * per_rank)
        vocab = range(min(rank * stretch, spec.vocab_size), min((rank + 1) * stretch, spec.vocab_size))
        out.append(RankShare(rank, world, kv, range(kv.start * group, kv.stop * group), head_dim, ffn[rank], vocab))
    return out
