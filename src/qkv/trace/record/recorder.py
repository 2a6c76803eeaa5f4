"""`trace`: run a model or attention module once and record attention's named steps.

Forward hooks on the selected attention modules see each call's input and output; the
adapters (`qkv.trace.record.adapters`) re-derive queries, keys and values from the module's own
parameters. For the selected heads and query tokens the explicit steps are then computed
and kept: q ⊙ k, q · k, the scaled scores, the mask, the softmax weights and each head's
context. The trace is faithful by construction: the recorded context rows, merged with
the other heads' rows from the fused kernel, are passed through the module's output
projection and must reproduce the module's real output, or `TraceMismatchError` is raised.

Bounded: only the selected heads × queries × keys are recorded (plus O(T·C) per layer);
q ⊙ k (D times larger) is recomputed from the recorded q and keys when asked.

Shape legend: B batch, T new tokens, S key tokens (cache included), C input features,
H query heads, H_kv key/value heads, D head size; h and t are the numbers of selected
heads and queries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.kernels import fused_attention
from qkv.attention.softcap import softcapped_attention
from qkv.errors import QkvError
from qkv.trace.record.views import html_view
from qkv.trace.record.adapters import AttentionCall, adapter_for, dropout_p, explain_call, num_heads, supported_types

Selection = int | Sequence[int] | None


class TraceMismatchError(RuntimeError):
    """The explicit steps did not reproduce the module's output: no picture is drawn."""


@dataclass
class LayerTrace:
    """The recorded steps of one attention module's call, for the selected heads/queries."""

    index: int  # among the traceable attention modules, in model order
    name: str  # module path in the model ("" for a bare module)
    kind: str  # module class name
    num_heads: int
    num_kv_heads: int
    head_dim: int
    heads: list[int]  # selected query heads
    kv_heads: list[int]  # the key/value head each selected query head reads
    queries: list[int]  # selected queries, indices into the T new tokens
    cache_length: int  # keys already cached before this call (S - T)
    scale: float
    causal: bool
    rope: bool
    x: Tensor  # (B, T, C)
    W_query: Tensor  # (C, H*D)
    W_key: Tensor  # (C, H_kv*D)
    W_value: Tensor  # (C, H_kv*D)
    b_query: Tensor | None
    b_key: Tensor | None
    b_value: Tensor | None
    q_unrotated: Tensor  # (B, h, t, D) before RoPE
    q: Tensor  # (B, h, t, D)
    k_unrotated: Tensor  # (B, h, T, D) the new keys before RoPE, per selected head
    keys: Tensor  # (B, h, S, D) every key each selected head compares with
    values: Tensor  # (B, h, S, D)
    scores: Tensor  # (B, h, t, S) q · k
    scaled: Tensor  # (B, h, t, S) scores * scale, -inf where masked
    mask: Tensor  # (B, h, t, S) bool, True = may attend
    weights: Tensor  # (B, h, t, S) softmax of the scaled scores
    context: Tensor  # (B, h, t, D) weights @ values
    concat: Tensor  # (B, t, H*D) every head's context side by side
    output: Tensor  # (B, t, C_out) the module's output rows for the selected queries
    cos: Tensor | None = None  # (T, D) RoPE rotations of the new tokens
    sin: Tensor | None = None
    window: int | None = None  # a local layer's sliding window (keys a query sees); None: global

    @property
    def is_local(self) -> bool:
        return self.window is not None

    def outside_window(self, query: int) -> list[bool]:
        """(S,) per key: hidden from `query` (an index among the new tokens) because it lies
        before the query's window, not because it comes after the query."""
        if self.window is None:
            return [False] * self.num_keys
        position = self.cache_length + query
        return [s <= position - self.window for s in range(self.num_keys)]

    @property
    def products(self) -> Tensor:
        """(B, h, t, S, D) q ⊙ k, one vector per key: the recorded q and keys multiplied,
        computed when asked so a trace holds no D-times-larger tensor."""
        return self.q.unsqueeze(-2) * self.keys.unsqueeze(-3)

    @property
    def num_keys(self) -> int:
        return self.keys.shape[2]

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    def query_heads_of(self, kv_head: int) -> list[int]:
        g = self.group_size
        return list(range(kv_head * g, (kv_head + 1) * g))

    def head_slot(self, head: int) -> int:
        if head not in self.heads:
            raise QkvError(f"head {head} of layer {self.index} was not recorded; recorded: {self.heads}")
        return self.heads.index(head)

    def query_slot(self, query: int) -> int:
        if query not in self.queries:
            raise QkvError(
                f"query {query} of layer {self.index} was not recorded; recorded: {self.queries}"
            )
        return self.queries.index(query)


@dataclass
class Trace:
    """What `trace` recorded: one LayerTrace per selected attention module, and the output."""

    layers: list[LayerTrace]
    output: Any
    tokens: list[str] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def _repr_html_(self) -> str:
        """Jupyter's view of a trace: weights tables and figures (qkv.trace.render.notebook)."""
        return html_view(self)

    def layer(self, index: int) -> LayerTrace:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise QkvError(f"layer {index} was not recorded; recorded: {[l.index for l in self.layers]}")


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every traceable attention module, in model order (the order layers are counted)."""
    found = [(name, m) for name, m in model.named_modules() if adapter_for(m) is not None]
    if not found:
        raise QkvError(
            f"{type(model).__name__} contains no attention module qkv can trace "
            f"(supported: {supported_types()})"
        )
    return found


def _select(selection: Selection, count: int, what: str, counted: str = "from 0") -> list[int]:
    if selection is None:
        return list(range(count))
    items = [selection] if isinstance(selection, int) else list(selection)
    if not items:
        raise QkvError(f"select at least one {what}")
    chosen = []
    for item in items:
        if not -count <= int(item) < count:
            raise QkvError(
                f"{what} {item} is out of range: there are {count} ({counted}: 0..{count - 1})"
            )
        index = int(item) % count
        if index not in chosen:
            chosen.append(index)
    return chosen


def _tolerances(dtype: torch.dtype) -> dict[str, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 2e-2, "atol": 2e-2}
    return {"rtol": 1e-4, "atol": 1e-5}


def _check(what: str, actual: Tensor, expected: Tensor, where: str) -> None:
    try:
        torch.testing.assert_close(actual, expected, **_tolerances(expected.dtype))
    except AssertionError as error:
        first = str(error).strip().splitlines()
        raise TraceMismatchError(
            f"{where}: the explicit steps do not reproduce {what} ({' '.join(first[:3])})"
        ) from None


def record_call(index: int, name: str, module: nn.Module, call: AttentionCall, real_output: Tensor,
                heads: Selection, queries: Selection) -> LayerTrace:
    """Explicit steps for the selected heads and queries, checked against the real output."""
    where = f"layer {index} ({name or type(module).__name__})"
    h_all, h_kv = num_heads(module)
    b, t = call.x.shape[0], call.x.shape[1]
    s = call.keys.shape[2]
    head_ids = _select(heads, h_all, "head")
    query_ids = _select(queries, t, "query", "counted from 0 here")
    group = h_all // h_kv
    kv_ids = [h // group for h in head_ids]
    hs, qs, kvs = (torch.tensor(head_ids), torch.tensor(query_ids), torch.tensor(kv_ids))

    # The new keys/values the call cached must be the ones recomputed from its input.
    if s != t:
        _check("the cached keys", call.keys[:, :, s - t:], call.k_new, where)

    full_mask = call.mask
    if full_mask is not None and full_mask.dim() < 4:
        full_mask = full_mask.reshape((1,) * (4 - full_mask.dim()) + tuple(full_mask.shape))
    if call.softcap is None:
        reference = fused_attention(call.q, call.keys, call.values, mask=full_mask,
                                    scale=call.scale)  # (B, H, T, D) every head, every query
    else:
        reference, _ = softcapped_attention(call.q, call.keys, call.values, mask=full_mask, scale=call.scale,
                                            softcap=call.softcap)  # (B, H, T, D)

    q = call.q[:, hs][:, :, qs]  # (B, h, t, D)
    keys = call.keys[:, kvs]  # (B, h, S, D)
    values = call.values[:, kvs]  # (B, h, S, D)
    products = q.unsqueeze(-2) * keys.unsqueeze(-3)  # (B, h, t, S, D): q ⊙ k
    scores = products.sum(-1)  # (B, h, t, S): q · k
    if full_mask is None:
        visible = torch.ones(b, len(head_ids), len(query_ids), s, dtype=torch.bool)
    else:
        visible = full_mask.expand(b, h_all, t, s)[:, hs][:, :, qs]  # (B, h, t, S)
    scaled = scores * call.scale
    if call.softcap is not None:  # what the softmax sees: the capped scores (Gemma 2)
        scaled = torch.tanh(scaled / call.softcap) * call.softcap
    scaled = scaled.masked_fill(~visible, -torch.inf)
    weights = torch.softmax(scaled.float(), dim=-1).to(q.dtype)  # (B, h, t, S)
    weights = weights.masked_fill(~visible.any(-1, keepdim=True), 0.0)
    context = weights @ values  # (B, h, t, D)
    _check("the fused kernel's context", context, reference[:, hs][:, :, qs], where)

    merged = reference.clone()
    merged[:, hs.view(-1, 1), qs.view(1, -1)] = context  # (B, H, T, D)
    concat = merged.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)
    output = concat if call.out_proj is None else call.out_proj(concat)
    expected = real_output.detach()
    if call.unbatched:
        expected = expected.unsqueeze(0)
    _check("the module's output", output, expected.reshape(output.shape), where)

    return LayerTrace(
        index=index, name=name, kind=type(module).__name__, num_heads=h_all, num_kv_heads=h_kv,
        head_dim=call.q.shape[-1], heads=head_ids, kv_heads=kv_ids, queries=query_ids,
        cache_length=s - t, scale=call.scale, causal=call.causal, rope=call.cos is not None,
        x=call.x, W_query=call.W_query, W_key=call.W_key, W_value=call.W_value,
        b_query=call.b_query, b_key=call.b_key, b_value=call.b_value,
        q_unrotated=call.q_unrotated[:, hs][:, :, qs], q=q,
        k_unrotated=call.k_unrotated[:, kvs], keys=keys, values=values,
        scores=scores, scaled=scaled, mask=visible, weights=weights,
        context=context, concat=concat[:, qs], output=output[:, qs], cos=call.cos, sin=call.sin,
        window=getattr(module, "window", None),
    )


def _checked_modules(module_or_model: nn.Module, layer: Selection, head: Selection) -> list[tuple[int, str, nn.Module]]:
    modules = attention_modules(module_or_model)
    chosen = []
    for i in _select(layer, len(modules), "layer"):
        name, module = modules[i]
        _select(head, num_heads(module)[0], "head")
        if module.training and dropout_p(module) > 0:
            raise QkvError(
                f"layer {i} ({name or type(module).__name__}) is in training mode with dropout; "
                "call .eval() on the model before tracing"
            )
        chosen.append((i, name, module))
    return chosen


@contextlib.contextmanager
def recording(
    module_or_model: nn.Module,
    *,
    layer: Selection = None,
    head: Selection = None,
    query: Selection = None,
) -> Iterator[dict[int, list[LayerTrace]]]:
    """Record the selected steps of every call the selected attention layers get while the
    `with` block runs (a whole generation, say): {layer index: [one LayerTrace per call]}.
    Each record is checked against the module's real output, as in `trace`."""
    chosen = _checked_modules(module_or_model, layer, head)
    records: dict[int, list[LayerTrace]] = {i: [] for i, _, _ in chosen}
    handles = []

    def make_hook(index: int, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
            with torch.no_grad():
                call = explain_call(module, args, kwargs)
                records[index].append(record_call(index, name, module, call, output, head, query))

        return hook

    try:
        for i, name, module in chosen:
            handles.append(module.register_forward_hook(make_hook(i, name), with_kwargs=True))
        yield records
    finally:
        for handle in handles:
            handle.remove()


def trace(
    module_or_model: nn.Module,
    inputs: Any,
    *,
    layer: Selection = None,
    head: Selection = None,
    query: Selection = None,
    tokens: Sequence[str] | None = None,
    **forward_kwargs: Any,
) -> Trace:
    """Run `module_or_model(inputs, **forward_kwargs)` once and record the selected steps.

    layer: attention modules counted from 0 in model order; head: query heads from 0;
    query: query tokens from 0 among the call's new tokens (negative counts from the end).
    None selects all. Raises QkvError for a selection out of range, TraceMismatchError if
    the recorded steps do not reproduce what the module computed.
    """
    with recording(module_or_model, layer=layer, head=head, query=query) as records, torch.no_grad():
        output = module_or_model(inputs, **forward_kwargs)
    missing = [i for i, calls in records.items() if not calls]
    if missing:
        raise QkvError(f"layers {missing} were not called by this forward; nothing to record")
    twice = [i for i, calls in records.items() if len(calls) > 1]
    if twice:
        raise QkvError(f"layer {twice[0]} was called twice in one traced forward")
    return Trace(layers=[calls[0] for calls in records.values()], output=output,
                 tokens=None if tokens is None else list(tokens))
