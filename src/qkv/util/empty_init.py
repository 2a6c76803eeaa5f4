"""Building a model whose weights are about to be loaded, without initialising them first.

    with parameters_on_meta():
        model = LlamaForCausalLM(cfg)      # parameters on the meta device, buffers real
    model.load_state_dict(state, assign=True)

Why: `nn.Linear` and `nn.Embedding` fill their weights with random numbers as they are
made (kaiming_uniform_, normal_), and a loader overwrites every one of them at once. For
SmolLM2-135M that drawing took about 0.9 s of a 2-core CPU's start-up, and copying the
loaded weights into place another pass over 540 MB. A parameter on the meta device has a
shape and dtype but no storage, so initialising it costs nothing, and
`load_state_dict(..., assign=True)` (PyTorch's documented way to fill such a model) makes
the loaded tensors the parameters instead of copying them.

Why not `with torch.device("meta")`: that puts buffers on the meta device too, and the
buffers a model computes as it is made (RoPE's inverse frequencies) are in no checkpoint,
so they would be lost. Here only parameters move: a parameter-registration hook swaps each
new parameter for a meta one, before the module's own init runs on it. The hook is global
in PyTorch, so it acts only in the thread that entered the context.

The `torch.nn.init` functions are also skipped on meta parameters (a TorchFunctionMode,
PyTorch's documented way to intercept torch functions): random fills of a meta tensor run
PyTorch's Python reference implementations, whose first use imports Dynamo, 2.7 s of
SmolLM2's start-up here for an `nn.Embedding.normal_` that computes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

_local = threading.local()
_lock = threading.Lock()
_users = 0
_handle: torch.utils.hooks.RemovableHandle | None = None


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or not getattr(_local, "depth", 0) or param.is_meta:
        return None  # keep it as it is
    return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


class _SkipInitOnMeta(TorchFunctionMode):
    """`torch.nn.init.*(tensor)` returns a meta tensor untouched; everything else runs."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules made inside get their parameters on the meta device (no storage, no
    initialisation); buffers and everything else stay where they would have been."""
    global _users, _handle
    with _lock:
        if _users == 0:
            _handle = register_module_parameter_registration_hook(_to_meta)
        _users += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with _SkipInitOnMeta():
            yield
    finally:
        _local.depth -= 1
        with _lock:
            _users -= 1
            if _users == 0 and _handle is not None:
                _handle.remove()
                _handle = None


def meta_names(model: nn.Module) -> list[str]:
    """Parameters and buffers still on the meta device (a model not fully loaded)."""
    return [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
