"""Which rank holds what: whole KV heads with the query heads that share them (the heads
GroupedQueryAttention groups together), features split at block boundaries, every head,
feature and vocabulary row held by exactly one rank; N that does not divide the KV heads refused."""

from __future__ import annotations

import pytest

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.errors import QkvError
from qkv.models.configs.decoder_spec import DecoderSpec
from qkv.models.configs.layer_spec import AttentionSpec, LayerSpec, MlpSpec
from qkv.models.tensor_parallel.assignment import check_world, feature_split, shares, working_sizes


def spec(heads: int, kv_heads: int, features: int, vocab: int = 1000) -> DecoderSpec:
    layer = LayerSpec(AttentionSpec(heads, kv_heads, 64), MlpSpec(features))
    return DecoderSpec("llama", vocab, 576, (layer, layer), 2048)


@pytest.mark.parametrize(("heads", "kv_heads", "world"), [(9, 3, 3), (32, 8, 2), (32, 8, 4), (32, 8, 8), (4, 4, 2)])
def test_every_head_feature_and_token_is_held_once_with_its_group(heads: int, kv_heads: int, world: int) -> None:
    features, vocab = 5632, 32001
    got = shares(spec(heads, kv_heads, features, vocab), world)
    attention = GroupedQueryAttention(576, heads, num_kv_heads=kv_heads, head_dim=64)
    for share in got:
        assert [q for g in share.kv_heads for q in attention.query_heads_of(g)] == list(share.query_heads)
        assert share.query_rows == range(share.query_heads.start * 64, share.query_heads.stop * 64)
    assert [g for s in got for g in s.kv_heads] == list(range(kv_heads))
    assert [f for s in got for f in s.features] == list(range(features))
    assert [v for s in got for v in s.vocabulary] == list(range(vocab))


def test_features_split_at_super_block_boundaries_where_they_can() -> None:
    assert [len(r) for r in feature_split(5632, 4)] == [1536, 1536, 1280, 1280]  # 22 super-blocks of 256
    assert all(r.start % 256 == 0 for r in feature_split(5632, 4))
    assert [len(r) for r in feature_split(96, 2)] == [64, 32]  # 3 blocks of 32
    assert [len(r) for r in feature_split(30, 4)] == [8, 8, 7, 7]  # no block fits: evenly


def test_n_that_does_not_divide_the_kv_heads_is_refused_with_the_ones_that_work() -> None:
    assert working_sizes(8) == [1, 2, 4, 8]
    with pytest.raises(QkvError, match=r"--tensor-parallel 2 does not divide smollm2's 3 key/value heads .*"
                                       r"choose --tensor-parallel 1, 3$"):
        check_world(3, 2, "smollm2")
    with pytest.raises(QkvError, match=r"gemma's 1 key/value head .* it cannot be split: run it on one process"):
        shares(spec(4, 1, 1152), 2, "gemma")
    check_world(8, 4, "llama")
