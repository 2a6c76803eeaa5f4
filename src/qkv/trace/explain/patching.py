"""Key and value patching: change one key (or value) and watch what the model does instead.

Attribution (`qkv.trace.explain.attribution`) says which sources make a score; patching says what
the prediction depends on. A forward hook on the key (or value) projection of one layer
replaces its output at one position: with that position's projection from another prompt,
with the mean over this prompt's positions (mean ablation), or with one source's share
removed (keys only, the attention norm's scale held at its real value, as the attribution
holds it). Everything after the projection (k-norm, RoPE, the cache, the kernel) runs as
the model runs it; the model code is not touched. A patch with the key's own value returns
the same tensor values, so the run is bit-identical to an unpatched one.

    outcome = patch(model, ids, layer=3, position=5, donor=keys_of_other, observe=(3, 4, 11))
    sweep = patch_sweep(model, ids, layers=range(30))      # which keys the prediction needs

Shape legend: B batch (one patched copy per position in a sweep), T tokens, C embedding,
H_kv key/value heads, D head size, F = H_kv*D projected features, V vocabulary.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.trace.explain.attribution import norm_scales, record_forward
from qkv.trace.record.recorder import recording
from qkv.trace.record.residual import linear_weight, residual_layout

Kind = Literal["key", "value"]
# Logits of a sweep's batch are bounded before they are allocated.
MAX_SWEEP_BYTES = 256 * 2**20
TOP_TOKENS = 5


def _attention(model: nn.Module, layer: int) -> nn.Module:
    blocks = residual_layout(model).blocks
    if not -len(blocks) <= layer < len(blocks):
        raise QkvError(f"layer {layer} is out of range: the model has {len(blocks)} (0..{len(blocks) - 1})")
    return blocks[layer].attention


def _columns(attention: nn.Module, kind: Kind) -> slice:
    """Where the key (value) features sit in the stacked q/k/v output, or all of k_proj's."""
    q, k, v = attention.projection_sizes
    return slice(q, q + k) if kind == "key" else slice(q + k, q + k + v)


@contextlib.contextmanager
def editing_projection(attention: nn.Module, kind: Kind,
                       edit: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """While the block runs, `edit` maps the layer's keys (values) as projected, (B, T, F),
    to the ones the layer uses instead. Hooks k_proj / v_proj, or the stacked qkv_proj."""
    layers = attention.projection_layers()
    if isinstance(layers, tuple):
        target = layers[1] if kind == "key" else layers[2]

        def hook(module, args, output):
            return edit(output)
    else:
        target, cols = layers, _columns(attention, kind)

        def hook(module, args, output):
            out = output.clone()
            out[..., cols] = edit(output[..., cols])
            return out

    handle = target.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def projections(model: nn.Module, input_ids: Tensor, layer: int, kind: Kind = "key") -> Tensor:
    """(T, F) the keys (values) of `layer` as projected for `input_ids` (1, T): a donor."""
    return all_projections(model, input_ids, [layer], kind)[layer]


@torch.no_grad()
def all_projections(model: nn.Module, input_ids: Tensor, layers: Sequence[int], kind: Kind = "key") -> dict[int, Tensor]:
    """{layer: (T, F)} the projected keys (values) of several layers, from one forward."""
    kept: dict[int, Tensor] = {}
    with contextlib.ExitStack() as stack:
        for layer in layers:
            def keep(x: Tensor, layer: int = layer) -> Tensor:
                kept[layer] = x[0].detach().clone()
                return x

            stack.enter_context(editing_projection(_attention(model, layer), kind, keep))
        with last_position_only(model):
            model(input_ids)
    return kept


@contextlib.contextmanager
def last_position_only(model: nn.Module) -> Iterator[None]:
    """While it lasts, the final norm passes on only the last position, so the output head
    computes the one distribution a patch is judged by: logits (B, 1, V)."""
    handle = residual_layout(model).final_norm.register_forward_hook(lambda m, a, out: out[:, -1:])
    try:
        yield
    finally:
        handle.remove()


def feature_mask(attention: nn.Module, kv_heads: Sequence[int] | None) -> Tensor:
    """(F,) True on the features of the chosen key/value heads (all when None)."""
    d, h_kv = attention.head_dim, attention.num_kv_heads
    chosen = torch.zeros(h_kv, d, dtype=torch.bool)
    for h in range(h_kv) if kv_heads is None else kv_heads:
        if not 0 <= h < h_kv:
            raise QkvError(f"key/value head {h} is out of range: the layer has {h_kv} (0..{h_kv - 1})")
        chosen[h] = True
    return chosen.flatten()


def replace_at(position: Tensor, donor: Tensor, features: Tensor) -> Callable[[Tensor], Tensor]:
    """An edit putting donor[b] (B, F) at position[b] of batch item b, on `features` only."""

    def edit(x: Tensor) -> Tensor:
        out = x.clone()
        rows = torch.arange(x.shape[0])
        current = out[rows, position]  # (B, F)
        out[rows, position] = torch.where(features, donor.to(x.dtype), current)
        return out

    return edit


def source_share(model: nn.Module, input_ids: Tensor, layer: int, source: str) -> Tensor:
    """(T, F) one source's share of `layer`'s projected keys at every position, with the
    attention norm's real per-token scale (what removing the source from the keys subtracts)."""
    record = record_forward(model, input_ids, layers=[layer])
    layer = layer % len(record.layout.blocks)
    attention = record.layout.blocks[layer].attention
    w_k = linear_weight(attention.projection_layers()[1]) if isinstance(attention.projection_layers(), tuple) \
        else linear_weight(attention.qkv_proj)[_columns(attention, "key")]  # (F, C)
    positions = torch.arange(record.length)
    a, w, shift, centred = norm_scales(record, layer, positions)
    if source == "norm shift" and shift is not None:
        return (shift @ w_k.double().T).expand(record.length, -1)
    if source == "k bias":
        bias = attention.projection_layers()[1].bias if isinstance(attention.projection_layers(), tuple) \
            else None if attention.qkv_proj.bias is None else attention.qkv_proj.bias[_columns(attention, "key")]
        if bias is None:
            raise QkvError(f"layer {layer}'s key projection has no bias")
        return bias.detach().double().expand(record.length, -1)
    share = _residual_share(record, layer, source)  # (T, C)
    if centred:
        share = share - share.mean(-1, keepdim=True)
    return (a * w * share) @ w_k.double().T


def remove_share(share: Tensor, features: Tensor) -> Callable[[Tensor], Tensor]:
    """An edit subtracting share (T, F) from every position's keys, on `features` only."""

    def edit(x: Tensor) -> Tensor:
        return x - torch.where(features, share, torch.zeros_like(share)).to(x.dtype)

    return edit


def _residual_share(record, layer: int, source: str) -> Tensor:
    """(T, C) what `source` wrote into the residual stream entering `layer`."""
    src = record.sources
    if source in src.embeddings:
        return src.embeddings[source].double()
    match = re.fullmatch(r"L(\d+)\.(H(\d+)|o_bias|mlp|attn)", source)
    if match is None or int(match.group(1)) >= layer:
        raise QkvError(f"--patch-source {source!r} is not a source of layer {layer}'s keys: give "
                       f"{', '.join(src.embeddings)}, L<l>.H<h>, L<l>.attn, L<l>.o_bias or L<l>.mlp with l < {layer}"
                       ", 'norm shift' or 'k bias'")
    l, part = int(match.group(1)), match.group(2)
    t = record.length
    bias = src.o_bias(l)
    if part == "mlp":
        return src.mlp_out[l].double()
    if part == "o_bias":
        if bias is None:
            raise QkvError(f"layer {l}'s output projection has no bias")
        return bias.double().expand(t, -1)
    heads = src.head_outputs(l)  # (T, H, C)
    if part == "attn":
        return heads.sum(1) + (0 if bias is None else bias.double())
    h = int(match.group(3))
    if h >= heads.shape[1]:
        raise QkvError(f"layer {l} has {heads.shape[1]} heads (0..{heads.shape[1] - 1}); {source!r} is not one")
    return heads[:, h]


@dataclass
class PatchOutcome:
    """What one patch changed: the observed head's weights of its query row, that layer's
    output at the query, and the next-token distribution after the last token."""

    weights_before: Tensor  # (S,)
    weights_after: Tensor  # (S,)
    layer_change: float  # |Δ layer output at the query| / |layer output at the query|
    kl: float  # KL(before || after) of the next-token distribution, in nats
    top_before: list[tuple[int, float]]  # (token id, probability)
    top_after: list[tuple[int, float]]
    extras: dict = field(default_factory=dict)


def _top(probs: Tensor, count: int = TOP_TOKENS) -> list[tuple[int, float]]:
    values, ids = probs.topk(count)
    return [(int(i), float(v)) for i, v in zip(ids, values)]


def kl_divergence(before: Tensor, after: Tensor) -> Tensor:
    """KL(before || after) over the last dimension of two logit tensors, in nats (float64)."""
    p = torch.log_softmax(before.double(), -1)
    q = torch.log_softmax(after.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


@torch.no_grad()
def patch(model: nn.Module, input_ids: Tensor, *, layer: int, edit: Callable[[Tensor], Tensor],
          kind: Kind = "key", observe: tuple[int, int, int]) -> PatchOutcome:
    """Run `input_ids` (1, T) unpatched and with `edit` applied to `layer`'s keys (values);
    observe = (layer, head, query) whose weights and output are compared."""
    o_layer, o_head, o_query = observe
    o_layer = o_layer % len(residual_layout(model).blocks)
    runs = []
    for patched in (False, True):
        context = editing_projection(_attention(model, layer), kind, edit) if patched else contextlib.nullcontext()
        with recording(model, layer=o_layer, head=o_head, query=o_query) as records, context, \
                last_position_only(model):
            logits = model(input_ids)  # (1, 1, V)
        runs.append((logits[0, -1], records[o_layer][-1]))
    (before, seen), (after, changed) = runs
    out_before, out_after = seen.output[0, 0].double(), changed.output[0, 0].double()
    return PatchOutcome(
        weights_before=seen.weights[0, 0, 0].clone(), weights_after=changed.weights[0, 0, 0].clone(),
        layer_change=float((out_after - out_before).norm() / out_before.norm().clamp_min(1e-30)),
        kl=float(kl_divergence(before, after)),
        top_before=_top(before.double().softmax(-1)), top_after=_top(after.double().softmax(-1)),
    )


@dataclass
class SweepRow:
    layer: int
    kl: list[float]  # per position: KL(before || after) of the next-token distribution
    target_drop: list[float]  # per position: fall in the probability of the unpatched top token


@dataclass
class PatchSweep:
    kind: Kind
    donor: str  # "mean" or "prompt"
    top_token: int  # the unpatched prediction
    top_probability: float
    rows: list[SweepRow]

    def strongest(self, count: int = 3) -> list[tuple[int, int, float]]:
        """(layer, position, KL) of the `count` patches that changed the prediction most."""
        cells = [(r.layer, p, kl) for r in self.rows for p, kl in enumerate(r.kl)]
        return sorted(cells, key=lambda c: -c[2])[:count]


@torch.no_grad()
def patch_sweep(model: nn.Module, input_ids: Tensor, *, layers: Sequence[int], kind: Kind = "key",
                donor_ids: Tensor | None = None, kv_heads: Sequence[int] | None = None) -> PatchSweep:
    """For each layer and position, patch that one key (value) in every chosen KV head with
    the donor prompt's at the same position (same length), or with the mean over this
    prompt's positions, and measure the next-token distribution after the last token.
    One batched forward per layer: batch item b patches position b."""
    t = int(input_ids.shape[1])
    if donor_ids is not None and donor_ids.shape != input_ids.shape:
        raise QkvError(f"--patch-from needs a prompt of the same length: it has {donor_ids.shape[1]} "
                       f"tokens, the text {t}; reword it so the positions line up")
    layers = list(layers)
    with last_position_only(model):
        base = model(input_ids)[0, -1]  # (V,)
    # Per patched copy: its activations (T tokens, a few C- and F-wide tensors per layer,
    # reused layer to layer) and one distribution; bounded before the batch is built.
    embedding_dim = int(residual_layout(model).embeddings[0][1].embedding_dim)
    width = max(int(base.numel()), 16 * embedding_dim * t)
    chunk = max(1, min(t, MAX_SWEEP_BYTES // (width * 8)))
    probs = base.double().softmax(-1)
    top = int(probs.argmax())
    owns = all_projections(model, input_ids, layers, kind)
    donors = all_projections(model, donor_ids, layers, kind) if donor_ids is not None else None
    rows = []
    for layer in layers:
        attention = _attention(model, layer)
        features = feature_mask(attention, kv_heads)
        donor = donors[layer] if donors is not None else owns[layer].mean(0, keepdim=True).expand(t, -1)
        kl, drop = [], []
        for start in range(0, t, chunk):
            positions = torch.arange(start, min(start + chunk, t))
            batch = input_ids.expand(positions.numel(), -1)
            with editing_projection(attention, kind, replace_at(positions, donor[positions], features)), \
                    last_position_only(model):
                logits = model(batch)[:, -1]  # (B, V)
            kl.extend(float(v) for v in kl_divergence(base.expand_as(logits), logits))
            drop.extend(float(probs[top] - p) for p in logits.double().softmax(-1)[:, top])
        rows.append(SweepRow(layer, kl, drop))
    return PatchSweep(kind, "mean" if donor_ids is None else "prompt", top, float(probs[top]), rows)
