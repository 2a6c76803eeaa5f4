"""qkv's native kernels against the same products written in torch: int8 weights times float32
activations exactly (up to summation order), 4-bit blocks times activations rounded per block
of 32 (`round_activations`), with and without bias, over drawn shapes; the block layout's
packing; and the ops under torch.compile (fake implementations, no graph break)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.runtime.native import native_kernels
from qkv.attention.kernels import one_query_attention, reduction_attention
from qkv.runtime.native.ops import (decode_attention, dequantize_blocks, f32_linear, int4_linear, int4_linear_reference, int8_linear,
                            pack_blocks, round_activations, unpack_blocks)

needs_kernels = pytest.mark.skipif(not native_kernels().available,
                                   reason=f"qkv's kernels are not available here: {native_kernels().reason}")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 8), blocks=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_block_packing_round_trips(n, blocks, seed) -> None:
    values = torch.randint(0, 16, (n, 32 * blocks), generator=torch.Generator().manual_seed(seed))
    packed = pack_blocks(values)
    assert packed.shape == (n, 16 * blocks) and packed.dtype == torch.uint8
    assert torch.equal(unpack_blocks(packed).long(), values)
    # GGUF's layout: byte j of a block holds element j (low nibble) and element j + 16 (high)
    assert int(packed[0, 0]) == int(values[0, 0]) | (int(values[0, 16]) << 4)


def test_rounded_activations_are_int8_steps_of_the_block_maximum() -> None:
    x = torch.randn(3, 64) * torch.tensor([1e-3, 1.0, 1e3])[:, None]
    x[1, :32] = 0.0  # an all-zero block stays zero
    rounded = round_activations(x)
    step = x.reshape(3, 2, 32).abs().amax(-1, keepdim=True) / 127
    codes = rounded.reshape(3, 2, 32) / torch.where(step > 0, step, 1.0)
    assert torch.allclose(codes, codes.round(), atol=1e-3) and int(codes.abs().max().round()) == 127
    assert ((rounded - x).reshape(3, 2, 32).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (rounded[1, :32] == 0).all()


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 41), k=st.integers(1, 150), seed=st.integers(0, 2**16),
       bias=st.booleans())
def test_int8_kernel_is_the_float_product_of_the_int8_weights(m, n, k, seed, bias) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) + 0.01
    b = torch.randn(n, generator=g) if bias else None
    expected = x.double() @ (w.double() * scales.double()[:, None]).t()
    if b is not None:
        expected = expected + b.double()
    got = int8_linear(x, w, scales, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-4 * (1 + k ** 0.5), rtol=1e-5)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 41), k=st.integers(1, 150), seed=st.integers(0, 2**16),
       bias=st.booleans())
def test_float32_kernel_is_the_linear_layers_product(m, n, k, seed, bias) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = f32_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * (1 + k ** 0.5), rtol=1e-5)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 41), blocks=st.integers(1, 6), seed=st.integers(0, 2**16),
       bias=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_int4_kernel_is_the_product_of_rounded_activations_and_4_bit_blocks(m, n, blocks, seed, bias, scale) -> None:
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(m, k, generator=g) * scale
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, blocks, generator=g) * 0.1).half()
    mn = (torch.randn(n, blocks, generator=g) * 0.1).half()
    b = torch.randn(n, generator=g) if bias else None
    got = int4_linear(x, q, d, mn, b)
    expected = int4_linear_reference(x.double(), q, d, mn, None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.double(), atol=1e-4 * scale * blocks, rtol=1e-4)
    # the float16 bits in int16 tensors, as qkv's layers keep them, give the same numbers
    assert torch.equal(int4_linear(x, q, d.view(torch.int16), mn.view(torch.int16), b), got)


@needs_kernels
def test_int4_kernel_is_close_to_the_float_product() -> None:
    """What the activation rounding costs: well under 1% of the output's scale."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 576), torch.randn(96, 576) * 0.05
    from qkv.runtime.linear.quantized import quantize_groups

    q, d, m = quantize_groups(w)
    exact = x @ dequantize_blocks(q, d, m).t()
    relative = (int4_linear(x, q, d, m) - exact).abs().max() / exact.abs().max()
    assert relative < 0.01


@needs_kernels
@pytest.mark.parametrize("bad, match", [
    (lambda x, w, s: (x.double(), w, s), "float32"),
    (lambda x, w, s: (x, w[:, :-1], s), "disagree"),
    (lambda x, w, s: (x[:, ::2], w[:, ::2].contiguous(), s), "contiguous"),
])
def test_int8_kernel_refuses_wrong_inputs_in_one_line(bad, match) -> None:
    x, w, s = torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    with pytest.raises(RuntimeError, match=match):
        int8_linear(*bad(x, w, s))


@needs_kernels
def test_int4_kernel_refuses_inputs_that_are_not_whole_blocks() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32"):
        int4_linear(torch.randn(1, 48), torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1).half(),
                    torch.zeros(4, 1).half())


@needs_kernels
def test_the_ops_compile_as_one_graph_with_the_eager_numbers() -> None:
    torch.manual_seed(0)
    w = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    s = torch.rand(40)
    q = torch.randint(0, 256, (40, 32), dtype=torch.uint8)
    d, mn = (torch.rand(40, 2) * 0.1).half(), (torch.randn(40, 2) * 0.1).half()

    def both(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(int8_linear(x, w, s)) + int4_linear(x * 2, q, d, mn)

    x = torch.randn(3, 64)
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")  # fails on a graph break
    torch.testing.assert_close(compiled(x), both(x), rtol=0, atol=0)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), groups=st.integers(1, 4), h_kv=st.integers(1, 3), s=st.integers(1, 70),
       d=st.sampled_from([3, 8, 16, 64]), masked=st.sampled_from(["none", "per row", "per head"]),
       seed=st.integers(0, 2**16))
def test_decode_attention_is_the_reductions_softmax(b, groups, h_kv, s, d, masked, seed) -> None:
    """Against `reduction_attention` (PyTorch's softmax and sums): grouped heads, any key count,
    masks per row or per head, rows that see no key at all (zeros)."""
    g = torch.Generator().manual_seed(seed)
    h = groups * h_kv
    q, k, v = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h_kv, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g)
    mask = None
    if masked == "per row":
        mask = torch.rand(b, 1, 1, s, generator=g) > 0.4
        mask[0] = False  # the first row sees nothing
    elif masked == "per head":
        mask = torch.rand(b, h, 1, s, generator=g) > 0.4
    expected = reduction_attention(q, k, v, mask=mask)
    visible = None if mask is None else mask.expand(b, h, 1, s).reshape(b, h, s).contiguous()
    got = decode_attention(q.reshape(b, h, d).contiguous(), k, v, visible, d ** -0.5).unsqueeze(2)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(one_query_attention(q, k, v, mask=mask), expected, atol=2e-6, rtol=2e-5)
