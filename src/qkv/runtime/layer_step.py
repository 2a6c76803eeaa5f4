"""A whole decode step on qkv's kernel: every layer and the head in one native call.

A decode step of a small model is mostly dispatch: SmolLM2's 30 layers are about 40
PyTorch operations each (norms, RoPE, the cache write, the attention, the shortcuts), each
a few microseconds of Python and dispatcher around a few hundred nanoseconds of work,
against one pass over the weights that qkv's kernels make in 6-8 ms. Compiling each layer
with Inductor fuses the small operations but leaves its own Python around every region
(Dynamo's guards, the wrappers): 14 ms a step of overhead, measured, against about 1 ms
for the same step as 30 calls of `qkv::decoder_layer`, which runs a layer's norms,
products, RoPE, cache write, attention, activation and shortcuts in C++ (runtime/native/csrc/layer.cpp).
A session binds its caches once: every layer's description, linear lists and cache buffers
are checked then and kept in C++ (runtime/native/csrc/stack.cpp, under a handle released
with the session), with the final norm and the output head where the model tells them
(`head_parts()`), so a step is one `qkv::stack_step` call that parses nothing and returns
the logits.

The C++ reads each layer's description (`qkv.models.configs.layer_spec.LayerSpec`, packed by
`qkv.runtime.layer_step_spec`): every family hands its own (`layer_specs()`: the SpecDecoder
families Llama, Qwen, Gemma 2/3, Phi-3, Mistral, SmolLM3, OLMo 2, and GPT-2) with the tensors
they name (`layer_parts()`: post-norms, q/k norms, each layer's RoPE frequencies). A layer is declined
by what its description says (`declined`: LongRoPE, say), not by a list of codes kept beside
the C++.

    step = NativeLayerStep.for_model(model)   # qkv.runtime.prepare.prepare_for_decoding does this
    # then: step.bound_to(model, caches) per session (qkv.runtime.session); None: the modules run
    logits = bound(x, positions)              # (B, 1, C) -> (B, 1, V), one native call
    logits = bound.prompt(x, positions, rows, wanted)   # prompt tokens (M, C) of any cache rows -> (R, V)

Which calls it takes: one new token per row (a decode step), or prompt tokens of any cache
rows, each prompt's at consecutive positions (`prompt`: several prompts' pieces in one call,
the head run on the tokens asked for only), float32, no gradients, no extra mask, and caches
whose kind gives `kernel_buffers()` (StaticKVCache, SlotKVCache) or is a sliding-window ring
(`WindowKVCache.kernel_ring()`: the kernel writes slot p mod W and keeps the ring's key
positions, as the ring's own `update` does; a prompt piece that reaches past the window has its
queries read the ring as it was before the piece plus the piece's own keys, as `update` answers);
other kinds run the layers as modules. A session that records the modules with hooks (a trace, `qkv.trace`)
asks the runtime for the module step (`step="modules"`), so its hooks see every step.

The math is the layers': the same weights through the same kernels (`qkv::int4_linear`'s
activation rounding included) in the same order, so its logits match the module path to
float rounding (tests/runtime/test_layer_step.py and test_native_families.py). Where the
activations are rounded (int4, and the GGUF block types: to int8 steps per block of inputs)
that bound is looser than it sounds, because rounding is not continuous: the modules' float32
RMSNorm (PyTorch's summation order) and the kernel's (double sums) differ in the last bit, and
an activation that lies on a step boundary then moves by a whole step (1/127 of its block's
largest), a difference the later tokens' attention carries on. On SmolLM2's Q4_1 file the two
paths' logits for a chat prompt differ by up to about 2, decode steps and
prompts alike (2026-12-03), which can change a greedy answer; neither path is the other's
approximation, both are the precision's math. A prompt through `prompt` gives what the decode
steps give for its tokens one at a time, bit for bit (test_layer_step.py), so a prompt and its
answer run one computation.

Shape legend: B batch (rows), M prompt tokens of a call, R tokens whose logits are wanted, C
hidden size, V vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.attention.caches.window_cache import WindowKVCache
from qkv.models.configs.layer_spec import LayerSpec
from qkv.runtime.native import native_kernels
from qkv.runtime.linear.kernel import KernelLinear
from qkv.runtime.layer_step_spec import declined, layer_vectors, pack, packed_norm

if TYPE_CHECKING:
    from qkv.attention.caches.kv_cache import KVCache
    from qkv.models.decoder import CausalDecoder, HeadParts, LayerParts


def has_forward_hooks(model: CausalDecoder) -> bool:
    """Whether a forward hook is on any module of `model` (or on every module): a session
    entered then runs the modules, so the hooks see every step. (Checked once, when the
    session is entered: a hook put on later needs a session with step="modules".)"""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    own = getattr(model, "own_hooks", frozenset())  # a tensor-parallel rank's collectives: its native step makes them too
    return any(set(m._forward_hooks) - own or m._forward_pre_hooks for m in model.modules())


def linear_tensors(layer: nn.Module) -> list[Tensor] | None:
    """A linear layer as the kernel reads it, as the layer says (`KernelLinear.kernel_tensors`,
    qkv.runtime.linear.kernel), or None when it is not one qkv's kernels run."""
    return layer.kernel_tensors() if isinstance(layer, KernelLinear) else None


def _norm_weight(norm: nn.Module) -> Tensor | None:
    """A q/k norm's weight, None for none."""
    weight = getattr(norm, "weight", None)
    return None if isinstance(norm, nn.Identity) or not isinstance(weight, Tensor) else weight


def cache_buffers(cache: KVCache) -> tuple[Tensor, ...] | None:
    """What the kernel writes and reads of one layer's cache: (keys, values, lengths) of a cache
    that stores position p at slot p (`kernel_buffers`), (keys, values, lengths, key_positions)
    of a sliding-window ring (`WindowKVCache.kernel_ring`), or None for other kinds."""
    if isinstance(cache, WindowKVCache):
        return cache.kernel_ring()
    return cache.kernel_buffers()


def layer_arguments(parts: LayerParts, spec: LayerSpec | None,
                     buffers: tuple[Tensor, ...]) -> tuple[tuple[Any, ...], Tensor | None] | None:
    """The op's arguments before `positions` (qkv::decoder_layer's) and a ring's key_positions
    (None: a cache of slot p), or None when the layer cannot run natively: no description, one
    it declines, or tensors it does not read."""
    if spec is None or declined(spec) is not None:
        return None
    att = parts.attention
    linears = [linear_tensors(m) if m is not None else None for m in (att.qkv_proj, att.o_proj, parts.up, parts.down)]
    norms = [*parts.attn_norm, *parts.mlp_norm, *(parts.attn_post_norm or ()), *(parts.mlp_post_norm or ())]
    if (any(x is None for x in linears) or att.ring is not None
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms)):
        return None
    k_cache, v_cache, lengths = buffers[:3]
    if k_cache.dtype != torch.float32 or k_cache.shape[-1] != v_cache.shape[-1]:
        return None
    if len(buffers) == 4 and spec.attention.window is None:  # a ring for a layer that sees every key
        return None
    q_norm = parts.q_norm if parts.q_norm is not None else _norm_weight(att.q_norm)
    k_norm = parts.k_norm if parts.k_norm is not None else _norm_weight(att.k_norm)
    try:
        vectors = layer_vectors(spec, attn_norm=tuple(parts.attn_norm), mlp_norm=tuple(parts.mlp_norm),
                                attn_post_norm=parts.attn_post_norm, mlp_post_norm=parts.mlp_post_norm,
                                q_norm=q_norm, k_norm=k_norm, inv_freq=parts.inv_freq)
    except ValueError:  # the description and the modules disagree: run the modules
        return None
    ring = buffers[3] if len(buffers) == 4 else None
    return (pack(spec), vectors, *linears, k_cache, v_cache, lengths), ring


class NativeLayerStep:
    """A model's decode steps as one `qkv::stack_step` call each (module docstring).

    `for_model(model)` (at preparation) checks that every layer can run so; a session then
    takes its own copy bound to its caches (`bound_to`), so sessions on one model never
    share or undo each other's binding. When a session's cache kind does not fit, it runs
    the layers as modules and `on_modules` is called once (the runtime compiles the layers
    with Inductor then, for those other kinds).
    """

    def __init__(self, on_modules: Callable[[], object] | None = None) -> None:
        self._stack: _Stack | None = None  # the bound layers (and head) in qkv's C++ (stack.cpp)
        self._cache: KVCache | None = None  # the first layer's, asked which rows a call carries
        self._model: CausalDecoder | None = None
        self._on_modules = on_modules
        self.fallback: object = None  # what on_modules returned, once called

    @staticmethod
    def for_model(model: CausalDecoder, on_modules: Callable[[], object] | None = None) -> NativeLayerStep | None:
        """NativeLayerStep for `model` when qkv's kernels are loaded and its layers can run as
        one call each (checked on a one-row static cache), else None."""
        if not native_kernels().available or model.layer_parts() is None:
            return None
        probe = NativeLayerStep()
        probe.bind(model, [StaticKVCache(spec) for spec in model.cache_specs(1, 1)])
        if not probe.bound:
            return None
        return NativeLayerStep(on_modules)

    @property
    def bound(self) -> bool:
        return self._stack is not None

    def bound_to(self, model: CausalDecoder, caches: list[KVCache]) -> NativeLayerStep | None:
        """A copy of these layers bound to one session's `caches`, or None when they cannot
        run with that kind (then `on_modules` runs, once per model)."""
        session = NativeLayerStep()
        session.bind(model, caches)
        if session.bound:
            return session
        if self._on_modules is not None:
            on_modules, self._on_modules = self._on_modules, None
            self.fallback = on_modules()
        return None

    def bind(self, model: CausalDecoder, caches: list[KVCache]) -> None:
        parts = model.layer_parts()
        specs = list(model.layer_specs() or ())  # each family describes its own layers
        layers: list[tuple[tuple[Any, ...], Tensor | None]] | None = []
        for index, part in enumerate(parts or []):
            cache = caches[index] if index < len(caches) else None
            buffers = cache_buffers(cache) if cache is not None else None
            spec = specs[index] if index < len(specs) else None
            arguments = None if buffers is None else layer_arguments(part, spec, buffers)
            if arguments is None or layers is None:
                layers = None
                break
            layers.append(arguments)
        if not parts or not layers:
            self._stack, self._cache, self._model = None, None, None
            return
        self._stack = _open_stack(parts[0].attention.emb_dim, layers, model.head_parts())
        self._finalizer = weakref.finalize(self, torch.ops.qkv.stack_close.default, self._stack.handle)
        self._cache, self._model = caches[0], model

    def takes(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> bool:
        """Whether a call with these inputs is a decode step the native layers run (one token a row)."""
        return (self._stack is not None and mask is None and x.shape[1] == 1 and x.dtype == torch.float32
                and x.device.type == "cpu" and not torch.is_grad_enabled() and positions.numel() in (1, x.shape[0]))

    def takes_prompts(self) -> bool:
        """Whether prompt tokens may run natively (`prompt`): not with gradients. (On a
        sliding-window ring a piece that reaches past the window has its queries read a copy of
        the ring taken before the piece's writes: layer.cpp's RingCopy.)"""
        return self._stack is not None and not torch.is_grad_enabled()

    @property
    def runs_head(self) -> bool:
        """Whether the final norm and the output head run in the same native call as the layers."""
        return self._stack is not None and self._stack.has_head

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, 1, C), positions (1,) or (B, 1) -> logits (B, 1, V): every layer and the head in
        one `qkv::stack_step` (the head in PyTorch where the kernel cannot run it); the caches
        hold the new keys and values (in the cache rows the call carries: `kernel_rows`)."""
        assert self._stack is not None and self._cache is not None
        b, _, c = x.shape
        where = positions.reshape(-1).to(torch.int64).expand(b).contiguous()  # (B,)
        return self._run(x.reshape(b, c), where, self._cache.kernel_rows(), None)[:, None]  # (B, 1, V)

    def prompt(self, x: Tensor, positions: Tensor, rows: Tensor, wanted: Tensor | None) -> Tensor:
        """Prompt tokens of any cache rows in one `qkv::stack_step`: token i, x[i] (M, C) float32,
        goes at positions[i] (M,) of cache row rows[i] (M,) -> the logits of the tokens `wanted`
        (R,) names (each prompt's last, say: the head over every token is most of a short
        prompt's work on a large vocabulary), (R, V), or every token's, (M, V). Every layer
        writes all the tokens' keys and values before any of them attends (stack.cpp), so a
        token sees its prompt's keys up to its own position: what the decode steps would give
        for the same tokens one at a time, bit for bit, since each token is computed alone."""
        return self._run(x, positions.to(torch.int64), rows.to(torch.int64), wanted)

    def pieces(self, pieces: list[tuple[int, Tensor, int]], wanted: list[int] | None) -> Tensor:
        """Prompt pieces (cache row, ids (t,), start) embedded and run in one `prompt` call ->
        the logits of token wanted[i] of piece i, (pieces, V), or of every token, (sum t, V), for None."""
        assert self._model is not None
        device = next(self._model.parameters()).device
        xs, where, rows, picked, first = [], [], [], [], 0
        for i, (row, ids, start) in enumerate(pieces):
            positions = torch.arange(start, start + ids.shape[0], device=device)  # (t,)
            xs.append(self._model.embed(ids.to(device)[None], positions)[0])  # (t, C)
            where.append(positions)
            rows.append(torch.full_like(positions, row))
            picked.append(first + (wanted[i] if wanted is not None else 0))
            first += ids.shape[0]
        heads = torch.tensor(picked, device=device) if wanted is not None else None  # (pieces,)
        return self.prompt(torch.cat(xs), torch.cat(where), torch.cat(rows), heads)

    def _run(self, x: Tensor, positions: Tensor, rows: Tensor | None, wanted: Tensor | None) -> Tensor:
        """x (M, C) at positions (M,) of cache rows (M,) (None: row i is cache row i) -> (M or R, V)."""
        assert self._stack is not None and self._model is not None
        hidden = x.contiguous()  # (M, C)
        head_rows = None if wanted is None else wanted.to(torch.int64).contiguous()  # (R,)
        out = torch.ops.qkv.stack_step.default(self._stack.handle, hidden, positions.contiguous(),
                                               None if rows is None else rows.contiguous(),
                                               head_rows if self._stack.has_head else None)
        if self._stack.has_head:
            return out  # (M or R, V)
        states = out if head_rows is None else out.index_select(0, head_rows)  # (M or R, C)
        return self._model.head(states[None])[0]  # (M or R, V)


@dataclass(frozen=True)
class _Stack:
    handle: int  # qkv::stack_open's
    has_head: bool


def _open_stack(hidden: int, layers: list[tuple[tuple[Any, ...], Tensor | None]], head: HeadParts | None) -> _Stack:
    """The layers (and the head, where the kernel can run it) bound once as one native stack."""
    handle = int(torch.ops.qkv.stack_open.default())
    try:
        for arguments, ring in layers:
            torch.ops.qkv.stack_add_layer.default(handle, hidden, *arguments, ring)
        head_linear = None if head is None else linear_tensors(head.head)
        if head is None or head_linear is None or any(t.dtype != torch.float32 for t in head.norm_tensors):
            return _Stack(handle, False)
        kind, norm = packed_norm(head.norm, head.norm_tensors)
        torch.ops.qkv.stack_set_head.default(handle, kind, head.norm.eps, norm, head_linear, head.softcap or 0.0)
        return _Stack(handle, True)
    except BaseException:
        torch.ops.qkv.stack_close.default(handle)
        raise
