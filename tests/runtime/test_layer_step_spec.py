"""`qkv::decoder_layer` executing a `LayerSpec`: one decode step of drawn layers (pre/post
norms of each kind with weight offsets, q/k norms, full / partial / no RoPE, score scale,
soft-cap, sliding window, learned sinks, SwiGLU / GeGLU / plain GELU feed-forwards) against the same step
written with PyTorch's functions; a sliding-window ring's step against `WindowKVCache.update`
(after histories with rewinds); every row of a batch as that row alone, bit for bit, in
every variant; and descriptions the C++ cannot run declined by what they say."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention.caches.kv_cache import CacheSpec
from qkv.attention.caches.window_cache import WindowKVCache
from qkv.models.configs.layer_spec import AttentionSpec, LayerSpec, MlpSpec, NormSpec, RopeSpec
from qkv.runtime.native import native_kernels
from qkv.runtime.native.ops import use_variant, variants
from qkv.runtime.layer_step_spec import FIELDS, declined, layer_vectors, pack, rope_frequencies

needs_kernels = pytest.mark.skipif(not native_kernels().available,
                                   reason=f"qkv's kernels are not available here: {native_kernels().reason}")
C, F_SIZE = 32, 48


def _norm_weights(norm: NormSpec | None, g: torch.Generator, size: int = C) -> tuple[torch.Tensor, ...] | None:
    if norm is None:
        return None
    weight = torch.randn(size, generator=g) * 0.2 + (1.0 - norm.weight_offset)
    return (weight, torch.randn(size, generator=g) * 0.1) if norm.bias else (weight,)


def _layer(spec: LayerSpec, seed: int) -> dict:
    """Random float32 weights for `spec`."""
    g = torch.Generator().manual_seed(seed)
    att, mlp = spec.attention, spec.mlp
    qkv_out = (att.num_heads + 2 * att.num_kv_heads) * att.head_dim
    up_out = 2 * mlp.intermediate_size if mlp.gated else mlp.intermediate_size
    over_all = att.qk_norm_over == "all"  # OLMo 2: one norm over every head's channels
    q_width, k_width = (att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim) if over_all else (att.head_dim,) * 2
    return {
        "attn_norm": _norm_weights(spec.attn_norm, g), "attn_post_norm": _norm_weights(spec.attn_post_norm, g),
        "mlp_norm": _norm_weights(spec.mlp_norm, g), "mlp_post_norm": _norm_weights(spec.mlp_post_norm, g),
        "q_norm": None if att.qk_norm is None else _norm_weights(att.qk_norm, g, q_width)[0],
        "k_norm": None if att.qk_norm is None else _norm_weights(att.qk_norm, g, k_width)[0],
        "qkv": torch.randn(qkv_out, C, generator=g) * 0.2, "qkv_bias": torch.randn(qkv_out, generator=g) * 0.1,
        "o": torch.randn(C, att.num_heads * att.head_dim, generator=g) * 0.2,
        "up": torch.randn(up_out, C, generator=g) * 0.2,
        "down": torch.randn(C, mlp.intermediate_size, generator=g) * 0.2,
        "sinks": torch.randn(att.num_heads, generator=g) if att.sinks else None,
    }


def _norm(spec: NormSpec | None, tensors, x: torch.Tensor) -> torch.Tensor:
    if spec is None:
        return x
    weight = tensors[0] + spec.weight_offset
    if spec.kind == "rms":
        return F.rms_norm(x, (x.shape[-1],), weight, spec.eps)
    return F.layer_norm(x, (x.shape[-1],), weight, tensors[1] if spec.bias else None, spec.eps)


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}[name](x)


def _project(spec: LayerSpec, w: dict, x: torch.Tensor, positions: torch.Tensor):
    """norm_a, qkv, q/k norms and RoPE: x (B, C) -> q (B, H, D), k, v (B, H_kv, D)."""
    att = spec.attention
    h_q, h_kv, d = att.num_heads, att.num_kv_heads, att.head_dim
    proj = F.linear(_norm(spec.attn_norm, w["attn_norm"], x), w["qkv"], w["qkv_bias"])  # (B, (H + 2 H_kv) D)
    q, k, v = proj.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = q.reshape(-1, h_q, d), k.reshape(-1, h_kv, d), v.reshape(-1, h_kv, d)  # (B, heads, D)
    if att.qk_norm is not None and att.qk_norm_over == "all":  # over (heads * D) at once
        q = _norm(att.qk_norm, (w["q_norm"],), q.reshape(q.shape[0], -1)).reshape(q.shape)
        k = _norm(att.qk_norm, (w["k_norm"],), k.reshape(k.shape[0], -1)).reshape(k.shape)
    elif att.qk_norm is not None:
        q, k = _norm(att.qk_norm, (w["q_norm"],), q), _norm(att.qk_norm, (w["k_norm"],), k)
    if spec.rope is not None:
        r = spec.rope.rotary_dim
        angles = positions.float()[:, None] * rope_frequencies(spec.rope)  # (B, R/2)
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

        def turn(t: torch.Tensor) -> torch.Tensor:
            rot, rest = t[..., :r], t[..., r:]
            half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
            return torch.cat([rot * cos + half * sin, rest], dim=-1)

        q, k = turn(q), turn(k)
    return q, k, v


def _attend(spec: LayerSpec, w: dict, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row's query heads (H, D) over the keys and values it sees (H_kv, S', D) -> (H * D,)."""
    att = spec.attention
    group = att.num_heads // att.num_kv_heads
    kk, vv = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)  # (H, S', D)
    scores = torch.einsum("hd,hsd->hs", q, kk) * att.score_scale
    if att.softcap is not None:
        scores = att.softcap * torch.tanh(scores / att.softcap)
    if att.sinks:  # a learned logit per head joins the softmax and gives no value
        scores = torch.cat([scores, w["sinks"][:, None]], dim=-1)
    weights = torch.softmax(scores, -1)[:, :kk.shape[1]]  # (H, S')
    return torch.einsum("hs,hsd->hd", weights, vv).reshape(-1)


def _finish(spec: LayerSpec, w: dict, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """o, the shortcuts, post-norms and the feed-forward: x (B, C), context (B, H * D) -> (B, C)."""
    mlp = spec.mlp
    x = x + _norm(spec.attn_post_norm, w["attn_post_norm"], F.linear(context, w["o"]))
    up = F.linear(_norm(spec.mlp_norm, w["mlp_norm"], x), w["up"])
    hidden = (_activation(mlp.activation, up[:, :mlp.intermediate_size]) * up[:, mlp.intermediate_size:]
              if mlp.gated else _activation(mlp.activation, up))
    return x + _norm(spec.mlp_post_norm, w["mlp_post_norm"], F.linear(hidden, w["down"]))


def reference_step(spec: LayerSpec, w: dict, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """One decode step of `spec` in PyTorch: x (B, C); keys/values (B, H_kv, S, D) written in place."""
    att = spec.attention
    q, k, v = _project(spec, w, x, positions)
    out = []
    for row in range(x.shape[0]):
        p = int(positions[row])
        keys[row, :, p], values[row, :, p] = k[row], v[row]
        start = 0 if att.window is None else max(0, p + 1 - att.window)
        out.append(_attend(spec, w, q[row], keys[row, :, start:p + 1], values[row, :, start:p + 1]))
    return _finish(spec, w, x, torch.stack(out))


def native_step(spec: LayerSpec, w: dict, x, keys, values, lengths, positions, rows=None,
                key_positions=None) -> torch.Tensor:
    vectors = layer_vectors(spec, attn_norm=w["attn_norm"], attn_post_norm=w["attn_post_norm"],
                            mlp_norm=w["mlp_norm"], mlp_post_norm=w["mlp_post_norm"], q_norm=w["q_norm"],
                            k_norm=w["k_norm"], sinks=w["sinks"])
    return torch.ops.qkv.decoder_layer.default(x, pack(spec), vectors, [w["qkv"], w["qkv_bias"]], [w["o"]], [w["up"]],
                                               [w["down"]], keys, values, lengths, positions, rows, key_positions)


norms = st.one_of(st.none(), st.builds(NormSpec, kind=st.just("rms"), eps=st.sampled_from([1e-6, 1e-5]),
                                       weight_offset=st.sampled_from([0.0, 1.0])),
                  st.builds(NormSpec, kind=st.just("layer"), eps=st.just(1e-5), bias=st.booleans()))


@st.composite
def layer_specs(draw) -> LayerSpec:
    heads, kv_heads, head_dim = draw(st.sampled_from([(4, 2, 8), (2, 2, 16), (4, 1, 8), (2, 1, 12)]))
    rope = draw(st.sampled_from([None, "full", "partial"]))
    rotary = {None: None, "full": head_dim, "partial": head_dim // 2 if head_dim // 2 % 2 == 0 else head_dim}[rope]
    activation, gated = draw(st.sampled_from([("silu", True), ("gelu_tanh", True), ("gelu_tanh", False),
                                              ("gelu", False), ("gelu", True)]))
    return LayerSpec(
        attention=AttentionSpec(heads, kv_heads, head_dim, scale=draw(st.sampled_from([None, 0.1])),
                                window=draw(st.sampled_from([None, 1, 3])), softcap=draw(st.sampled_from([None, 2.0])),
                                qk_norm=draw(st.sampled_from([None, NormSpec("rms", eps=1e-6)])),
                                qk_norm_over=draw(st.sampled_from(["head", "all"])),
                                sinks=draw(st.booleans())),
        mlp=MlpSpec(F_SIZE, activation, gated=gated),
        rope=None if rotary is None else RopeSpec(base=draw(st.sampled_from([100.0, 10000.0])), rotary_dim=rotary),
        attn_norm=draw(norms), attn_post_norm=draw(norms), mlp_norm=draw(norms), mlp_post_norm=draw(norms))


def _state(spec: LayerSpec, batch: int, seed: int, slots: int = 12):
    g = torch.Generator().manual_seed(seed + 1)
    shape = (batch, spec.attention.num_kv_heads, slots, spec.attention.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    positions = torch.randint(0, slots, (batch,), generator=g)
    return torch.randn(batch, C, generator=g), keys, values, positions


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(spec=layer_specs(), seed=st.integers(0, 2**16))
def test_the_native_layer_runs_the_description_as_pytorch_does(spec: LayerSpec, seed: int) -> None:
    w = _layer(spec, seed)
    x, keys, values, positions = _state(spec, 3, seed)
    lengths = torch.zeros(3, dtype=torch.int64)
    want_keys, want_values = keys.clone(), values.clone()
    expected = reference_step(spec, w, x, want_keys, want_values, positions)
    got = native_step(spec, w, x, keys, values, lengths, positions)
    torch.testing.assert_close(got, expected, atol=1e-4 * (1 + expected.abs().max().item()), rtol=1e-4)
    torch.testing.assert_close(keys, want_keys, atol=1e-5, rtol=1e-5)  # the new keys, normed and turned
    torch.testing.assert_close(values, want_values, atol=1e-5, rtol=1e-5)
    assert torch.equal(lengths, positions + 1)


@needs_kernels
@settings(max_examples=6, deadline=None)
@given(spec=layer_specs(), seed=st.integers(0, 2**16))
def test_each_row_of_the_layer_is_computed_as_that_row_alone(spec: LayerSpec, seed: int) -> None:
    """Batch invariance of the whole layer, bit for bit, in every variant: four rows in one
    call against each row alone in its own call (the cache row given by `rows`)."""
    w = _layer(spec, seed)
    x, keys, values, positions = _state(spec, 4, seed)
    for variant in variants():
        with use_variant(variant):
            k1, v1, n1 = keys.clone(), values.clone(), torch.zeros(4, dtype=torch.int64)
            together = native_step(spec, w, x, k1, v1, n1, positions)
            k2, v2, n2 = keys.clone(), values.clone(), torch.zeros(4, dtype=torch.int64)
            alone = torch.cat([native_step(spec, w, x[i:i + 1].contiguous(), k2, v2, n2, positions[i:i + 1].contiguous(),
                                           torch.tensor([i])) for i in range(4)])
            assert torch.equal(together, alone), variant
            assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(n1, n2)


def _ring_with_history(spec: LayerSpec, window: int, history: list[tuple[int, int]], seed: int) -> WindowKVCache:
    """A ring of 3 rows after prompts written at (start, length) in turn: a later start below
    an earlier one's end is a rewind, one past it leaves a gap."""
    att = spec.attention
    cache = WindowKVCache(CacheSpec(batch_size=3, num_kv_heads=att.num_kv_heads, capacity=64, head_dim=att.head_dim,
                                    value_dim=att.head_dim, dtype=torch.float32, device=torch.device("cpu")),
                          window=window)
    g = torch.Generator().manual_seed(seed + 2)
    for start, length in history:
        shape = (3, att.num_kv_heads, length, att.head_dim)
        cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.arange(start, start + length))
    return cache


@needs_kernels
@settings(max_examples=15, deadline=None)
@given(spec=layer_specs(), window=st.integers(1, 6),
       history=st.lists(st.tuples(st.integers(0, 14), st.integers(1, 9)), min_size=1, max_size=3),
       some_rows=st.booleans(), seed=st.integers(0, 2**16))
def test_a_ring_step_writes_and_attends_as_the_window_cache_does(spec: LayerSpec, window: int, history, some_rows: bool,
                                                                 seed: int) -> None:
    """With key_positions the caches are a WindowKVCache's ring: the step forgets what a row held at
    its position and beyond, writes slot p mod W and attends over p - W < kp <= p, as `update` does."""
    spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, window=window))
    w = _layer(spec, seed)
    reference = _ring_with_history(spec, window, history, seed)
    native = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(seed + 3)
    rows = torch.tensor([2, 0]) if some_rows else None
    b = 3 if rows is None else 2
    x, positions = torch.randn(b, C, generator=g), torch.randint(0, 20, (b,), generator=g)  # rewinds, gaps, steps
    reference.selection.rows = rows
    q, k, v = _project(spec, w, x, positions)
    keys, values, visible = reference.update(k[:, :, None], v[:, :, None], positions[:, None])  # (b, H_kv, S, D)
    context = [_attend(spec, w, q[r], keys[r][:, visible[r, 0, 0]], values[r][:, visible[r, 0, 0]]) for r in range(b)]
    expected = _finish(spec, w, x, torch.stack(context))
    got = native_step(spec, w, x, native.k_cache, native.v_cache, native.lengths, positions, rows, native.key_positions)
    torch.testing.assert_close(got, expected, atol=1e-4 * (1 + expected.abs().max().item()), rtol=1e-4)
    assert torch.equal(native.key_positions, reference.key_positions)
    assert torch.equal(native.lengths, reference.lengths)
    torch.testing.assert_close(native.k_cache, reference.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.v_cache, reference.v_cache, atol=1e-5, rtol=1e-5)


@needs_kernels
@settings(max_examples=5, deadline=None)
@given(spec=layer_specs(), window=st.integers(1, 6),
       history=st.lists(st.tuples(st.integers(0, 14), st.integers(1, 9)), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_each_row_of_a_ring_step_is_computed_as_that_row_alone(spec: LayerSpec, window: int, history,
                                                                seed: int) -> None:
    """Batch invariance through a ring, bit for bit, in every variant: three rows in one call
    against each row alone (its cache row given by `rows`), rings and outputs alike."""
    spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, window=window))
    w = _layer(spec, seed)
    start = _ring_with_history(spec, window, history, seed)
    g = torch.Generator().manual_seed(seed + 4)
    x, positions = torch.randn(3, C, generator=g), torch.randint(0, 20, (3,), generator=g)
    for variant in variants():
        with use_variant(variant):
            together_ring = copy.deepcopy(start)
            together = native_step(spec, w, x, together_ring.k_cache, together_ring.v_cache, together_ring.lengths,
                                   positions, None, together_ring.key_positions)
            alone_ring = copy.deepcopy(start)
            alone = torch.cat([native_step(spec, w, x[i:i + 1].contiguous(), alone_ring.k_cache, alone_ring.v_cache,
                                           alone_ring.lengths, positions[i:i + 1].contiguous(), torch.tensor([i]),
                                           alone_ring.key_positions) for i in range(3)])
            assert torch.equal(together, alone), variant
            for name in ("k_cache", "v_cache", "key_positions", "lengths"):
                assert torch.equal(getattr(together_ring, name), getattr(alone_ring, name)), (variant, name)


@needs_kernels
def test_a_ring_of_other_sizes_or_past_its_positions_is_refused_in_one_line() -> None:
    spec = LayerSpec(attention=AttentionSpec(4, 2, 8, window=4), mlp=MlpSpec(F_SIZE), rope=RopeSpec(10000.0, 8))
    w = _layer(spec, 0)
    x = torch.randn(1, C)
    short = _ring_with_history(spec, 4, [(0, 2)], 0)  # a full window: any position
    native_step(spec, w, x[:1].expand(3, C).contiguous(), short.k_cache, short.v_cache, short.lengths,
                torch.tensor([100, 7, 3]), None, short.key_positions)
    assert short.key_positions[0].tolist() == [100, 1, -1, -1, -1]  # 100 at slot 100 mod 4; 1 kept, unseen
    shortened = WindowKVCache(CacheSpec(batch_size=1, num_kv_heads=2, capacity=3, head_dim=8, value_dim=8,
                                        dtype=torch.float32, device=torch.device("cpu")), window=4)  # 3 slots < W
    with pytest.raises(RuntimeError, match="a position lies outside the KV cache"):
        native_step(spec, w, x, shortened.k_cache, shortened.v_cache, shortened.lengths, torch.tensor([3]), None,
                    shortened.key_positions)
    with pytest.raises(RuntimeError, match="key_positions must be contiguous int64"):
        native_step(spec, w, x, shortened.k_cache, shortened.v_cache, shortened.lengths, torch.tensor([1]), None,
                    shortened.key_positions[:, :2].contiguous())


def test_descriptions_the_native_layer_lacks_are_declined_by_name() -> None:
    base = LayerSpec(attention=AttentionSpec(4, 2, 8), mlp=MlpSpec(F_SIZE), rope=RopeSpec(10000.0, 8))
    assert declined(base) is None
    over_all = dataclasses.replace(base, attention=dataclasses.replace(base.attention, qk_norm=NormSpec(), qk_norm_over="all"))
    assert declined(over_all) is None  # OLMo 2's q/k norm over all heads runs natively
    layer_qk = dataclasses.replace(base, attention=dataclasses.replace(base.attention, qk_norm=NormSpec("layer")))
    assert "layer q/k norm" in declined(layer_qk)
    with pytest.raises(ValueError, match="cannot run a layer q/k norm"):
        pack(layer_qk)
    longrope = dataclasses.replace(base, rope=RopeSpec(10000.0, 8, scaling=(("rope_type", "longrope"),)))
    assert "'longrope'" in declined(longrope)
    linear = dataclasses.replace(base, rope=RopeSpec(10000.0, 8, scaling=(("factor", 8.0), ("rope_type", "linear"))))
    assert declined(linear) is None  # Gemma 3's global layers
    torch.testing.assert_close(rope_frequencies(linear.rope), rope_frequencies(base.rope) / 8.0, rtol=0, atol=0)
    yarn = dataclasses.replace(base, rope=RopeSpec(10000.0, 8, scaling=(("factor", 4.0), ("rope_type", "yarn"))))
    assert "'yarn'" in declined(yarn)


def test_the_packed_description_follows_the_fields() -> None:
    spec = LayerSpec(attention=AttentionSpec(4, 2, 8, window=5, softcap=30.0), mlp=MlpSpec(F_SIZE, "gelu_tanh"),
                     rope=RopeSpec(10000.0, 4), attn_post_norm=NormSpec(eps=1e-5, weight_offset=1.0))
    packed = dict(zip(FIELDS, pack(spec).tolist()))
    assert packed["num_heads"] == 4 and packed["num_kv_heads"] == 2 and packed["head_dim"] == 8
    assert packed["rotary_dim"] == 4 and packed["window"] == 5 and packed["softcap"] == 30.0
    assert packed["attn_post_norm"] == 1 and packed["attn_post_norm_eps"] == 1e-5 and packed["mlp_post_norm"] == 0
    assert packed["activation"] == 1 and packed["gated"] == 1 and packed["scale"] == pytest.approx(8 ** -0.5)
    folded = layer_vectors(spec, attn_norm=(torch.ones(C),), attn_post_norm=(torch.zeros(C),), mlp_norm=(torch.ones(C),))
    assert torch.equal(folded[1], torch.ones(C))  # the post-norm's 1 + w, folded
    assert len(folded) == 4 and folded[-1].shape == (2,)  # three norms, then RoPE's frequencies


@needs_kernels
def test_a_description_of_another_layout_is_refused_in_one_line() -> None:
    spec = LayerSpec(attention=AttentionSpec(2, 2, 16), mlp=MlpSpec(F_SIZE), rope=RopeSpec(10000.0, 16))
    w = _layer(spec, 0)
    x, keys, values, positions = _state(spec, 1, 0)
    packed = pack(spec)
    packed[0] = 99  # another version of the field order
    vectors = layer_vectors(spec, attn_norm=w["attn_norm"], mlp_norm=w["mlp_norm"])
    with pytest.raises(RuntimeError, match="another version than this library's"):
        torch.ops.qkv.decoder_layer.default(x, packed, vectors, [w["qkv"]], [w["o"]], [w["up"]], [w["down"]], keys,
                                            values, torch.zeros(1, dtype=torch.int64), positions, None)
