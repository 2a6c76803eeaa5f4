"""Stacking linear layers that read the same input into one, for decoding.

At batch 1 a matrix product is one pass over its weight, with a fixed cost per call on
top; the query, key and value projections (and a SwiGLU's gate and up projections) read
the same input, so one product over their stacked rows gives the same numbers in fewer,
larger passes (measured on SmolLM2's shapes with PyTorch's int8 kernel: 20% less time for
those products). The stacked layer is an ordinary `nn.Linear`, so quantizing and
compiling treat it like any other.

Shape legend: K input features, N_i output features of layer i.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.util.empty_init import parameters_on_meta

# The stacked layers `stack_projections` makes and the checkpoint layers whose rows they hold, in order.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stacked_from(name: str) -> tuple[str, ...]:
    """The checkpoint layers a layer named `name` holds, in row order ("model.layers.0.self_attn.qkv_proj"
    -> its q_proj, k_proj, v_proj; an unstacked name -> itself)."""
    prefix, _, last = name.rpartition(".")
    return tuple(f"{prefix}.{part}" if prefix else part for part in STACKED[last]) if last in STACKED else (name,)


def stack_linears(layers: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the layers' outputs concatenated: (sum N_i, K) weight."""
    first = layers[0]
    if any(type(layer) is not nn.Linear for layer in layers):
        raise TypeError("only plain nn.Linear layers are stacked (fuse before quantizing)")
    if len({layer.in_features for layer in layers}) != 1 or len({layer.bias is None for layer in layers}) != 1:
        raise ValueError("stacked layers must share their input size and all have a bias or none")
    with parameters_on_meta():  # no random init for weights that are replaced at once
        stacked = nn.Linear(first.in_features, sum(layer.out_features for layer in layers),
                            bias=first.bias is not None, dtype=first.weight.dtype)
    grad = first.weight.requires_grad
    if first.weight.is_meta:  # a skeleton whose weights are assigned next: parameters_on_meta gave shapes
        stacked.requires_grad_(grad)  # (torch.cat of meta tensors would import Dynamo: 2 s of start-up)
        return stacked
    with torch.no_grad():
        stacked.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=grad)  # (sum N_i, K)
        if first.bias is not None:
            stacked.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]), requires_grad=grad)  # (sum N_i,)
    return stacked


def stack_projections(model: nn.Module) -> int:
    """Stack the projections of every layer of `model` that knows how (`stack_projections()`); returns the count."""
    stackable = [m for m in model.modules() if callable(getattr(m, "stack_projections", None)) and m is not model]
    for module in stackable:
        module.stack_projections()
    return len(stackable)
