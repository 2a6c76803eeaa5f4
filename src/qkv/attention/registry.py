"""One registry of attention functions, looked up by name (as transformers'
`ALL_ATTENTION_FUNCTIONS`): every attention call in qkv goes through `attention_function`.

    context = attention_function("fused")(q, k, v, mask=mask, is_causal=True, scale=None, dropout_p=0.0)

The registry imports nothing of qkv: the built-in functions register themselves when
qkv.attention.kernels is imported (every caller of `attention_function` is in that module).

Built in (qkv.attention.kernels):
- "explicit": the book's data flow step by step (scores, scale, mask, softmax, weights @ V);
- "fused": PyTorch's scaled_dot_product_attention; a single query without dropout (a decode
  step) goes to "one_query" instead, where SDPA is slower than a plain reduction;
- "one_query": one query over cached keys as two reductions (`reduction_attention`), unless
  a runtime registered a faster kernel of the same math under this name (qkv.runtime
  registers qkv's native decode attention once its library has loaded and passed its
  self-test: `register_attention`);
- "reductions": always the reductions;
- "quantized_decode" (registered by the runtime with qkv's kernels): one query over a
  quantized KV cache's packed codes, which the cache calls with its own buffers
  (qkv.attention.caches.quantized_cache; without it the cache dequantizes and runs the reductions).

Every function takes (..., H, T, D) queries, (..., H_kv, S, D) keys and values and keyword
arguments mask, is_causal, scale, dropout_p, and returns the (..., H, T, D_v) context.

Shape legend: H query heads, H_kv key/value heads, T queries, S keys, D head size.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

AttentionFunction = Callable[..., Tensor]

ATTENTION_FUNCTIONS: dict[str, AttentionFunction] = {}


def register_attention(name: str, function: AttentionFunction) -> None:
    """Make `function` the attention called `name` (a new one, or a faster one of the same math)."""
    ATTENTION_FUNCTIONS[name] = function


def attention_function(name: str) -> AttentionFunction:
    """The attention function registered as `name`; a name nobody registered is refused."""
    try:
        return ATTENTION_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{', '.join(sorted(ATTENTION_FUNCTIONS))}") from None
