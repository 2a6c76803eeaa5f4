"""qkv.book against the book's printed figures (chapter 3 of "Build a Large Language Model
(From Scratch)") and against a plain re-implementation that follows the book's code
structure step by step, written here independently of qkv's functional core."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.book import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

# "Your journey starts with one step": the book's 3-d embeddings of the six tokens.
INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],
        [0.55, 0.87, 0.66],
        [0.57, 0.85, 0.64],
        [0.22, 0.58, 0.33],
        [0.77, 0.25, 0.10],
        [0.05, 0.80, 0.55],
    ]
)
BATCH = torch.stack((INPUTS, INPUTS))  # (2, 6, 3), as the book batches it


def _close_to_printed(got: torch.Tensor, printed: list) -> None:
    """The book prints 4 decimals: our numbers must round to them."""
    expected = torch.tensor(printed)
    torch.testing.assert_close(got.detach(), expected, atol=1e-4, rtol=0.0)
    assert torch.equal(torch.round(got.detach() * 1e4), torch.round(expected * 1e4))


# ---- the book's printed figures ----------------------------------------------------------


def test_self_attention_v1_printed_figures():
    torch.manual_seed(123)
    out = SelfAttention_v1(3, 2)(INPUTS)
    _close_to_printed(
        out,
        [[0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203],
         [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]],
    )
    assert torch.allclose(out[1].detach(), torch.tensor([0.3061, 0.8210]), atol=1e-4)  # "journey"


def test_self_attention_v2_printed_figures():
    torch.manual_seed(789)
    _close_to_printed(
        SelfAttention_v2(3, 2)(INPUTS),
        [[-0.0739, 0.0713], [-0.0748, 0.0703], [-0.0749, 0.0702],
         [-0.0760, 0.0685], [-0.0763, 0.0679], [-0.0754, 0.0693]],
    )


def test_multihead_wrapper_printed_figures():
    torch.manual_seed(123)
    out = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(BATCH)
    assert out.shape == (2, 6, 4)
    _close_to_printed(
        out[0],
        [[-0.4519, 0.2216, 0.4772, 0.1063], [-0.5874, 0.0058, 0.5891, 0.3257],
         [-0.6300, -0.0632, 0.6202, 0.3860], [-0.5675, -0.0843, 0.5478, 0.3589],
         [-0.5526, -0.0981, 0.5321, 0.3428], [-0.5299, -0.1081, 0.5077, 0.3493]],
    )


def test_multihead_attention_printed_figures():
    torch.manual_seed(123)
    out = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)(BATCH)
    assert out.shape == (2, 6, 2)
    _close_to_printed(
        out[0],
        [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
         [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]],
    )


# ---- a plain re-implementation following the book's code structure -----------------------


class PlainSelfAttentionV1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys, queries, values = x @ self.W_key, x @ self.W_query, x @ self.W_value
        scores = queries @ keys.T
        return torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1) @ values


class PlainSelfAttentionV2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        scores = queries @ keys.T
        return torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1) @ values


class PlainCausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        _, n, _ = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        scores = queries @ keys.transpose(1, 2)
        scores = scores.masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        return weights @ values


class PlainWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [PlainCausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class PlainMultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        keys, queries, values = heads(self.W_key(x)), heads(self.W_query(x)), heads(self.W_value(x))
        scores = queries @ keys.transpose(2, 3)
        scores = scores.masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1))
        context = (weights @ values).transpose(1, 2).contiguous().view(b, n, self.d_out)
        return self.out_proj(context)


CASES = [
    # (ours, plain, constructor args, input)
    (SelfAttention_v1, PlainSelfAttentionV1, (3, 4), INPUTS),
    (SelfAttention_v2, PlainSelfAttentionV2, (3, 4, True), INPUTS),
    (CausalAttention, PlainCausalAttention, (3, 4, 8, 0.3, True), BATCH),
    (MultiHeadAttentionWrapper, PlainWrapper, (3, 2, 8, 0.3, 3), BATCH),
    (MultiHeadAttention, PlainMultiHeadAttention, (3, 6, 8, 0.3, 3, True), BATCH),
]
IDS = [case[0].__name__ for case in CASES]


@pytest.mark.parametrize("ours_cls,plain_cls,args,x", CASES, ids=IDS)
def test_same_parameters_same_seed_same_module(ours_cls, plain_cls, args, x):
    """Same creation order: a seed gives identical parameters and state_dict keys."""
    torch.manual_seed(42)
    ours = ours_cls(*args)
    torch.manual_seed(42)
    plain = plain_cls(*args)
    ours_state, plain_state = ours.state_dict(), plain.state_dict()
    assert list(ours_state) == list(plain_state)
    for key in plain_state:
        assert torch.equal(ours_state[key], plain_state[key]), key


@pytest.mark.parametrize("ours_cls,plain_cls,args,x", CASES, ids=IDS)
def test_state_dict_from_plain_code_loads_and_gives_same_outputs(ours_cls, plain_cls, args, x):
    torch.manual_seed(7)
    plain = plain_cls(*args)
    torch.manual_seed(99)  # different initial weights, replaced by the loaded ones
    ours = ours_cls(*args)
    ours.load_state_dict(plain.state_dict(), strict=True)
    x = x + 0.1 * torch.randn(x.shape)

    # Evaluation: no dropout, deterministic.
    ours.eval(), plain.eval()
    torch.testing.assert_close(ours(x), plain(x), atol=1e-6, rtol=1e-6)

    # Training: dropout draws from the global RNG exactly as the book's code does.
    ours.train(), plain.train()
    torch.manual_seed(2024)
    out_ours = ours(x)
    torch.manual_seed(2024)
    out_plain = plain(x)
    torch.testing.assert_close(out_ours, out_plain, atol=1e-6, rtol=1e-6)
    torch.manual_seed(2024)
    ours(x)
    after_ours = torch.rand(4)
    torch.manual_seed(2024)
    plain(x)
    assert torch.equal(after_ours, torch.rand(4))  # same RNG consumption

    # Gradients, W_key included, match too.
    probe = torch.randn(out_ours.shape)
    (out_ours * probe).sum().backward()
    (out_plain * probe).sum().backward()
    grads_ours = dict(ours.named_parameters())
    for name, param in plain.named_parameters():
        assert grads_ours[name].grad is not None, name
        torch.testing.assert_close(grads_ours[name].grad, param.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b,t,c,h", [(1, 1, 4, 2), (2, 6, 12, 3), (3, 10, 16, 4)])
def test_multihead_attention_matches_torch_multihead_attention(b, t, c, h):
    """nn.MultiheadAttention's in_proj/out_proj copied into W_query/W_key/W_value/out_proj;
    the book's class is causal, so torch gets the causal mask."""
    torch.manual_seed(t)
    ref = nn.MultiheadAttention(c, h, bias=True, batch_first=True).eval()
    ours = MultiHeadAttention(c, c, context_length=t + 2, dropout=0.0, num_heads=h, qkv_bias=True).eval()
    wq, wk, wv = ref.in_proj_weight.chunk(3)
    bq, bk, bv = ref.in_proj_bias.chunk(3)
    with torch.no_grad():
        for layer, w, bias in ((ours.W_query, wq, bq), (ours.W_key, wk, bk), (ours.W_value, wv, bv)):
            layer.weight.copy_(w)
            layer.bias.copy_(bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)
    x = torch.randn(b, t, c)
    hidden = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)  # torch: True = hidden
    with torch.no_grad():
        expected, _ = ref(x, x, x, attn_mask=hidden, is_causal=True, need_weights=False)
        torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-5)
        # Without the mask torch would differ (for more than one token): the test sees causality.
        if t > 1:
            unmasked, _ = ref(x, x, x, need_weights=False)
            assert not torch.allclose(ours(x), unmasked, atol=1e-4)


def test_unbatched_input_accepted_by_v1_and_v2():
    for cls in (SelfAttention_v1, SelfAttention_v2):
        torch.manual_seed(0)
        layer = cls(3, 2)
        unbatched = layer(INPUTS)
        assert unbatched.shape == (6, 2)
        torch.testing.assert_close(layer(BATCH)[1], unbatched, atol=1e-7, rtol=0.0)


def test_mask_is_the_books_buffer():
    layer = CausalAttention(3, 2, context_length=5, dropout=0.0)
    assert torch.equal(layer.mask, torch.triu(torch.ones(5, 5), diagonal=1))
    assert "mask" in layer.state_dict()


@pytest.mark.parametrize(
    "make,x,message",
    [
        (lambda: SelfAttention_v1(3, 2), torch.ones(6, 4), r"d_in=3.*\(6, 4\)"),
        (lambda: SelfAttention_v2(3, 2), torch.ones(2, 2, 6, 3), r"d_in=3.*\(2, 2, 6, 3\)"),
        (lambda: CausalAttention(3, 2, 6, 0.0), torch.ones(6, 3), r"\(batch, tokens, d_in\).*\(6, 3\)"),
        (lambda: CausalAttention(3, 2, 6, 0.0), torch.ones(1, 6, 5), r"d_in=3.*\(1, 6, 5\)"),
        (lambda: CausalAttention(3, 2, 6, 0.0), torch.ones(1, 7, 3), r"7 tokens.*context_length=6"),
        (lambda: MultiHeadAttention(3, 4, 6, 0.0, 2), torch.ones(2, 9, 3), r"9 tokens.*context_length=6"),
        (lambda: MultiHeadAttention(3, 4, 6, 0.0, 2), torch.ones(2, 6, 2), r"d_in=3.*\(2, 6, 2\)"),
        (lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2), torch.ones(1, 8, 3), r"8 tokens.*context_length=6"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(make, x, message):
    with pytest.raises(ValueError, match=message):
        make()(x)


def test_bad_constructor_arguments_raise_value_error():
    with pytest.raises(ValueError, match=r"d_out=5, num_heads=2"):
        MultiHeadAttention(3, 5, 6, 0.0, num_heads=2)
    with pytest.raises(ValueError, match=r"num_heads=0"):
        MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=0)
    with pytest.raises(ValueError, match=r"dropout=1.5"):
        CausalAttention(3, 2, 6, 1.5)
