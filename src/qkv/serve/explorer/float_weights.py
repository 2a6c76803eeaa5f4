"""The served model's quantized layers run on the float weights their blocks stand for, while
the context is open: what the explorer's "why" splits when the served arithmetic has no
exact split.

    with float_weights(model):          # on the engine thread, between decode steps
        result = attribute(model, ids, layer=..., head=..., query=..., keys=[...])

Why: the split of a score into its sources (qkv.trace.explain.attribution) is exact because
everything between the residual stream and q · k is linear once the norm scales are fixed.
float32's and int8's layers keep that (float activations times the weights their int8
values stand for), so their split is the served model's own; int4's layers round their activations to 8 bits per block of 32 (GGUF's Q8_1, the
kernel's math), which is not linear: no split of the served int4 score adds up, and the
attribution rightly refuses it. Here each int4 layer's output is replaced, through a
forward hook, by `x @ W^T + b` with W the float weights it stands for
(`Int4Linear.dequantized`, the same weights qkv.trace.record.adapters shows): a float32
model of the same weights, whose split is exact. The served model's own score is recorded
beside it (qkv.serve.explorer.why), so the page shows both, labelled.

Nothing is copied: one layer's float weights at a time, made during its call and dropped
after, as int4's own prompt path makes them. The hooks are removed when the
context closes, whatever happens inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.runtime.linear.quantized import Int4Linear


def _float_output(module: Int4Linear, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
    bias = module.bias
    y = F.linear(args[0].float(), module.dequantized(), None if bias is None else bias.float())
    return y.to(output.dtype)


def rounding_layers(model: nn.Module) -> list[Int4Linear]:
    """The layers of `model` whose products round their activations (int4's): the ones whose
    scores no exact split follows. int8's keep float activations and need no stand-in."""
    return [m for m in model.modules() if isinstance(m, Int4Linear)]


@contextlib.contextmanager
def float_weights(model: nn.Module) -> Iterator[int]:
    """Every int4 layer of `model` answers the float product of the weights it stands for
    while open (module docstring); yields how many layers that is (0: the model is unchanged)."""
    layers = rounding_layers(model)
    handles = [layer.register_forward_hook(_float_output) for layer in layers]
    try:
        yield len(layers)
    finally:
        for handle in handles:
            handle.remove()
