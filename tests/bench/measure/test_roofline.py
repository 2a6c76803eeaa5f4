"""Bytes per token, checked against sizes computed independently from the config, and
the measuring helpers (bandwidth, alternating timer) against their definitions."""

from __future__ import annotations

import statistics

import pytest
import torch

from qkv.attention.caches.kv_cache import CacheSpec, StaticKVCache
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.bench.measure import alternate, alternate_probed, kv_bytes_per_token, measure_read_bandwidth, ratio, roofline_tokens_per_s, token_bytes, weight_bytes_per_token
from qkv.runtime.linear import quantize

CFG = GPTConfig(vocab_size=101, context_length=32, emb_dim=48, n_heads=4, n_layers=3, drop_rate=0.0, qkv_bias=True)


def _linear_params(cfg: GPTConfig) -> int:
    """Weights and biases of every matrix of one pass, from the architecture."""
    c, bias = cfg.emb_dim, 1 if cfg.qkv_bias else 0
    per_layer = 3 * (c * c + bias * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
    norms = 2 * 2 * c
    return cfg.n_layers * (per_layer + norms) + 2 * c + c * cfg.vocab_size  # final norm, head


def test_weight_bytes_untied_tied_and_int8() -> None:
    model = GPT2Decoder(CFG)
    one_row_each = 2 * CFG.emb_dim  # token and position embedding
    assert weight_bytes_per_token(model) == 4 * (_linear_params(CFG) + one_row_each)
    model.tie_weights()  # the head is the token table: counted once, as a matrix
    assert weight_bytes_per_token(model) == 4 * (_linear_params(CFG) + CFG.emb_dim)
    quantize(model, "int8")
    c, v = CFG.emb_dim, CFG.vocab_size
    matrices = CFG.n_layers * (3 * c * c + c * c + 4 * c * c + 4 * c * c) + v * c
    rows = CFG.n_layers * (3 * c + c + 4 * c + c) + v  # one float32 scale per output row
    biases = CFG.n_layers * (3 * c + c + 4 * c + c)
    norms = CFG.n_layers * 4 * c + 2 * c
    embeddings = 2 * c
    expected = matrices + 4 * (rows + biases + norms + embeddings)
    assert weight_bytes_per_token(model) == expected


def test_int4_counts_packed_weights_and_group_scales() -> None:
    cfg = GPTConfig(vocab_size=101, context_length=32, emb_dim=64, n_heads=4, n_layers=3, drop_rate=0.0,
                    qkv_bias=True)  # widths the int4 kernels take (blocks of 32, outputs of 16)
    model = GPT2Decoder(cfg)
    quantize(model, "int4")
    c, v = cfg.emb_dim, cfg.vocab_size
    packed = cfg.n_layers * (3 * c * c + c * c + 4 * c * c + 4 * c * c) // 2  # two weights a byte
    blocks = cfg.n_layers * (3 * c * c + c * c + 4 * c * c + 4 * c * c) // 32  # per block of 32 inputs
    head = v * c + 4 * v  # the output head stays int8: a byte a weight and a float32 row scale
    biases = cfg.n_layers * (3 * c + c + 4 * c + c)
    norms = cfg.n_layers * 4 * c + 2 * c
    embeddings = 2 * c
    expected = packed + 2 * 2 * blocks + head + 4 * (biases + norms + embeddings)  # float16 d and m a block
    assert weight_bytes_per_token(model) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_match_the_caches_own_size(dtype: torch.dtype) -> None:
    model = GPT2Decoder(CFG).to(dtype)
    positions = 20
    caches = [StaticKVCache(spec) for spec in model.cache_specs(1, positions)]
    cache_bytes = sum(cache.nbytes for cache in caches)
    assert kv_bytes_per_token(caches, positions) == cache_bytes
    spec = CacheSpec(1, CFG.n_heads, positions // 2, CFG.head_dim, CFG.head_dim, dtype, torch.device("cpu"))
    half = StaticKVCache(spec).nbytes * CFG.n_layers
    assert token_bytes(model, caches, positions // 2).kv_cache == half
    assert kv_bytes_per_token([], positions) == 0


def test_roofline_is_bandwidth_over_bytes() -> None:
    assert roofline_tokens_per_s(500_000_000, 20.0) == pytest.approx(40.0)
    with pytest.raises(ValueError):
        roofline_tokens_per_s(0, 20.0)


def test_bandwidth_reports_the_median_of_its_samples() -> None:
    result = measure_read_bandwidth(8 * 2**20, repeats=5)
    assert len(result.samples_gb_per_s) == 5 and result.nbytes == 8 * 2**20
    assert result.gb_per_s == statistics.median(result.samples_gb_per_s) > 0
    with pytest.raises(ValueError):
        measure_read_bandwidth(1024)


def test_alternate_rotates_contenders_and_ratios_come_from_medians() -> None:
    calls: list[str] = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timed = alternate(contenders, work={"a": 10, "b": 20, "c": 30}, unit="tokens", repeats=6, warmup=2)
    assert calls[:6] == list("abcabc")  # warm-up, untimed
    rounds = [calls[6 + 3 * i : 9 + 3 * i] for i in range(6)]
    assert [r[0] for r in rounds] == list("abcabc")  # who goes first rotates
    assert all(sorted(r) == list("abc") for r in rounds)
    for name, m in timed.items():
        assert len(m.samples_s) == 6
        assert m.median_s == statistics.median(m.samples_s)
        assert m.rate == m.work / m.median_s
    r = ratio(timed["b"], timed["a"])
    assert r.value == (20 / timed["b"].median_s) / (10 / timed["a"].median_s)


def test_alternate_probed_puts_a_probe_on_either_side_of_every_call() -> None:
    calls: list[str] = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    probed = alternate_probed(contenders, lambda: calls.append("p"), work=4, unit="tokens", probe_work=100,
                              probe_unit="bytes", repeats=3, warmup=1)
    assert calls[:3] == ["a", "b", "p"]  # warm-up, untimed
    assert calls[3:] == list("papbpbpapapbp")  # a probe first, then one after every call
    assert probed.probe.work == 100 and len(probed.probe.samples_s) == 7
    probes = probed.probe.samples_s
    # each contender's k-th sample sits between probe samples (i, i + 1) of its place in the order
    assert probed.around["a"] == ((probes[0], probes[1]), (probes[3], probes[4]), (probes[4], probes[5]))
    assert probed.around["b"] == ((probes[1], probes[2]), (probes[2], probes[3]), (probes[5], probes[6]))
    assert all(len(m.samples_s) == 3 and m.work == 4 for m in probed.measurements.values())
    with pytest.raises(ValueError):
        alternate_probed(contenders, lambda: None, work=1, unit="t", probe_work=1, probe_unit="b", repeats=0)
