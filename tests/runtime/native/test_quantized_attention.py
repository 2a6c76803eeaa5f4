"""qkv::quantized_decode_attention (runtime/native/csrc/quantized_cache/attention.cpp) against attention written out
in torch over the cache's dequantized contents: int4 and int2 codes, keys per channel or per
token, before or after RoPE, sinks, grouped query heads, caches of many lengths (inside the
full-precision tail, at group boundaries, many groups), every variant the CPU runs (generic,
AVX2, AVX-512); a batch's rows equal to each row alone bit for bit; the torch fallback."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention.kernels import explicit_attention
from qkv.attention.caches.kv_cache import CacheSpec
from qkv.attention.caches.quantized_cache import QuantizedKVCache
from qkv.attention.rope import RotaryEmbedding, apply_rope
from qkv.attention.registry import ATTENTION_FUNCTIONS
from qkv.runtime.native import native_kernels
from qkv.runtime.native.ops import variants
from qkv.runtime.native_attention import register_native_attention

needs_kernels = pytest.mark.skipif(not native_kernels().available,
                                   reason=f"qkv's kernels are not available here: {native_kernels().reason}")
# the variants qkv's library runs on this CPU (qkv.runtime.native.ops.variants), the kernel's too
VARIANTS = [v for v in ("generic", "avx2", "avx512") if native_kernels().available and v in variants()]
if native_kernels().available:
    register_native_attention()  # what the runtime does when it prepares a model


def make_cache(*, batch: int = 2, kv_heads: int = 2, dim: int = 32, capacity: int = 160, bits: int = 4,
               key_axis: str = "channel", rope: str = "before", sinks: int = 0,
               rotary: RotaryEmbedding | None = None) -> QuantizedKVCache:
    rotary = RotaryEmbedding(dim, theta=500.0) if rotary is None else rotary
    spec = CacheSpec(batch, kv_heads, capacity, dim, dim, torch.float32, torch.device("cpu"), 0, rotary)
    return QuantizedKVCache(spec, bits=bits, group_size=16, residual=16, sinks=sinks, channel_group=16,
                            key_axis=key_axis, rope=rope)


def filled(cache: QuantizedKVCache, length: int, seed: int) -> QuantizedKVCache:
    """The cache after a prompt of `length` - 2 tokens and two one-token steps."""
    s = cache.spec
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(s.batch_size, s.num_kv_heads, length, s.head_dim, generator=g)
    k[..., 3] += 4.0  # a channel of large keys, as real models have
    v = torch.randn(s.batch_size, s.num_kv_heads, length, s.value_dim, generator=g)
    prompt = max(length - 2, 1)
    cache.update(k[:, :, :prompt], v[:, :, :prompt], torch.arange(prompt))
    for p in range(prompt, length):
        cache.update(k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor([p]))
    return cache


def expected(cache: QuantizedKVCache, q: torch.Tensor) -> torch.Tensor:
    """The book's attention over the dequantized contents, keys rotated at their positions."""
    keys, values = cache.contents()  # (B, H_kv, held, D)
    if cache.rotates_keys:
        assert cache.spec.rotary is not None
        cos, sin = cache.spec.rotary(torch.arange(keys.shape[2]))
        keys = apply_rope(keys, cos, sin)
    return explicit_attention(q.double(), keys.double(), values.double())[0].float()  # (B, H, 1, D_v)


def queries(cache: QuantizedKVCache, heads: int, seed: int) -> torch.Tensor:
    s = cache.spec
    return torch.randn(s.batch_size, heads, 1, s.head_dim, generator=torch.Generator().manual_seed(seed))


@needs_kernels
@pytest.mark.parametrize("bits,key_axis,rope,sinks", [
    (4, "channel", "before", 0), (2, "channel", "before", 4), (4, "token", "before", 0),
    (2, "token", "after", 0), (4, "channel", "after", 4)])
def test_the_kernel_is_attention_over_the_dequantized_cache(bits, key_axis, rope, sinks) -> None:
    for length in (3, 32, 33, 64, 157):  # tail (and sinks) only, group edges, many groups
        cache = filled(make_cache(bits=bits, key_axis=key_axis, rope=rope, sinks=sinks), length, seed=length)
        q = queries(cache, heads=6, seed=length)  # 3 query heads share each of the 2 KV heads
        want = expected(cache, q)
        torch.testing.assert_close(cache.attend(q, variant="torch"), want, atol=2e-5, rtol=1e-4)
        for variant in VARIANTS:
            got = cache.attend(q, variant=variant)
            assert got.shape == (2, 6, 1, 32)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{variant}: {m}")


@needs_kernels
def test_smollm2_shapes_and_odd_groups() -> None:
    # SmolLM2: head size 64, 9 query heads on 3 KV heads; and 7 heads on one KV head (blocks of 4 + 3);
    # 600 keys: three spans of the kernel's 256, merged
    for kv_heads, heads in ((3, 9), (1, 7)):
        cache = filled(make_cache(batch=1, kv_heads=kv_heads, dim=64, bits=4, capacity=640), 600, seed=heads)
        q = queries(cache, heads, seed=1) * 3
        want = expected(cache, q)
        for variant in VARIANTS:
            torch.testing.assert_close(cache.attend(q, variant=variant), want, atol=2e-5, rtol=1e-4)


@needs_kernels
def test_a_row_of_a_batch_is_that_row_alone_bit_for_bit() -> None:
    batch = filled(make_cache(batch=3, bits=2, sinks=4, capacity=320), 300, seed=7)  # two spans
    q = queries(batch, heads=4, seed=8)
    for row in range(3):
        alone = make_cache(batch=1, bits=2, sinks=4, capacity=320, rotary=batch.spec.rotary)
        names = [name for name, _ in batch.named_buffers() if name not in ("rope_cos", "rope_sin")]
        for name in names:  # the same stored row: codes, statistics, tail, sinks, counters
            mine = getattr(batch, name)
            getattr(alone, name).copy_(mine[row:row + 1] if mine.dim() == 4 else mine)
        for variant in VARIANTS:
            together = batch.attend(q, variant=variant)
            assert torch.equal(alone.attend(q[row:row + 1], variant=variant), together[row:row + 1]), variant


@needs_kernels
def test_an_empty_cache_attends_to_nothing_and_wrong_variants_are_refused() -> None:
    cache = make_cache()
    q = queries(cache, heads=2, seed=0)
    assert torch.equal(cache.attend(q, variant="generic"), torch.zeros(2, 2, 1, 32))
    odd = filled(make_cache(dim=24), 40, seed=0)  # 12 rotated pairs do not fill 8 or 16 lanes
    with pytest.raises(RuntimeError, match="do not fit"):
        odd.attend(queries(odd, heads=2, seed=0), variant="avx2")
    q = queries(odd, heads=2, seed=1)
    torch.testing.assert_close(odd.attend(q), expected(odd, q), atol=2e-5, rtol=1e-4)  # best: the generic one


@needs_kernels
def test_best_is_the_active_variant_under_the_cap() -> None:
    """One variant numbering and detection for every op: "best" runs what qkv::set_variant allows
    (kernels.h's active variant), so capping the library caps the attention too."""
    from qkv.runtime.native.ops import use_variant

    cache = filled(make_cache(bits=4), 64, seed=3)
    q = queries(cache, heads=6, seed=3)
    for variant in VARIANTS:
        with use_variant(variant):
            assert torch.equal(cache.attend(q, variant="best"), cache.attend(q, variant=variant)), variant


def test_a_decode_step_writes_then_attends_like_update_and_reduction_attention() -> None:
    """With or without the kernel, `decode_attention` is `update` then attention of the query at
    the newest position (the path a model's layer takes at each decode step)."""
    one, two = make_cache(bits=4, sinks=2), make_cache(bits=4, sinks=2)
    filled(one, 40, seed=3), filled(two, 40, seed=3)
    g = torch.Generator().manual_seed(5)
    k, v, q = (torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g),
               torch.randn(2, 4, 1, 32, generator=g))
    got = one.decode_attention(q, k, v, torch.tensor([40]))
    keys, values, visible = two.update(k, v, torch.tensor([40]))
    want = explicit_attention(q, keys, values, mask=visible, scale=1 / math.sqrt(32))[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert one.length == two.length == 41
    with pytest.raises(ValueError, match="one token"):
        one.decode_attention(q, torch.cat([k, k], 2), torch.cat([v, v], 2), torch.tensor([41, 42]))


@needs_kernels
@torch.no_grad()
def test_a_model_decodes_through_the_kernel_as_through_the_torch_reference(monkeypatch) -> None:
    """A Llama's decode steps with the int4 cache: through the kernel (the library loaded) and
    through `reference_attention` (the kernel not registered, as on a machine without a compiler)."""
    from qkv.models.llama import LlamaForCausalLM
    from qkv.models.configs.llama import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (1, 44))
    kind = QuantizedKVCache.kind(bits=4, group_size=8, residual=8)

    def logits() -> torch.Tensor:
        caches = [kind(spec) for spec in model.cache_specs(1, 64)]
        registered = "quantized_decode" in ATTENTION_FUNCTIONS
        assert all(cache._native_fits(torch.zeros(1, 4, 1, 16)) == registered for cache in caches)
        outs = [model(ids[:, :20], caches=caches)] + [model(ids[:, i:i + 1], caches=caches) for i in range(20, 44)]
        return torch.cat(outs, dim=1)

    native = logits()
    monkeypatch.delitem(ATTENTION_FUNCTIONS, "quantized_decode")
    torch.testing.assert_close(native, logits(), atol=1e-4, rtol=1e-4)
