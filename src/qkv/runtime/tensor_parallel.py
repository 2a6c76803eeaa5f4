"""One rank of a tensor-parallel decoder, prepared at a precision the way a whole model is.

    rank = open_rank(open_model(path, ...), join_tensor_parallel(N))     # qkv.models.tensor_parallel
    loaded, setup = prepare_rank(rank, "auto")

The rank's slices go through the same loaders as a whole file: "blocks" keeps the slices of a
GGUF file's block matrices as stored (`load_stored_blocks`), int4 on a Q4_0/Q4_1 file takes
their blocks byte for byte (`load_stored_four_bits`), and every other precision builds the
rank's float slices and prepares them with `prepare_for_decoding` (stacking, int8/int4
quantization, float kernels). Never compiled by Inductor. No prepared-weights cache either: a
rank's slice is not the file's model.

A decode step runs qkv's native layer on each rank, split at the all-reduces
(`TensorParallelLayerStep`): per layer, `qkv::decoder_layer` with part=1 runs the attention
half (norm, q/k/v, RoPE, the cache write, attention over the rank's heads, o_proj over its
columns) and returns the partial o_proj product; it is all-reduced and added to the residual
(through a post-norm where the family has one, as the modules do); part=2 runs the MLP half on
the sum and returns the partial down_proj product, all-reduced and added. The embedding's
all-reduce and the head's gather are the model's own. A layer the native kernel declines, a
cache kind it does not read, or a q/k norm over every head (OLMo 2: its statistic needs an
all-reduce inside the attention) runs the modules, whose hooks make the same all-reduces.

Shape legend: B rows of a decode step, C hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from qkv.attention.caches.kv_cache import StaticKVCache
from qkv.attention.stacking import stack_projections
from qkv.models.tensor_parallel.decoder import TensorParallelDecoder
from qkv.runtime.layer_step import cache_buffers, layer_arguments
from qkv.errors import QkvError
from qkv.names import AUTO, BLOCKS, resolve_precision
from qkv.runtime.huge_pages import place_on_huge_pages
from qkv.runtime.linear.float import use_native_float
from qkv.runtime.linear.quantized import activation_dtype, quantize
from qkv.runtime.native import native_kernels
from qkv.runtime.native_attention import register_native_attention
from qkv.runtime.prepare import DecodeSetup, block_products_run, check_precision, prepare_for_decoding
from qkv.runtime.stored_blocks import load_stored_blocks
from qkv.runtime.stored_four_bits import load_stored_four_bits

if TYPE_CHECKING:
    from torch import nn

    from qkv.attention.caches.kv_cache import KVCache

    from qkv.models.loader import LoadedModel
    from qkv.models.tensor_parallel.opened import RankOpened


def _empty_int4(model: nn.Module) -> None:
    """The rank's int4 layers made empty, for the file's blocks assigned next."""
    model.eval()
    stack_projections(model)
    quantize(model, "int4", empty=True)
    model.to(activation_dtype())


ATTENTION_PART, MLP_PART = 1, 2  # qkv::decoder_layer's `part` (csrc/kernels.h LayerPart)


class TensorParallelLayerStep:
    """A rank's decode step on qkv's native layer, two calls a layer with an all-reduce after
    each (module docstring). Answers what a session asks of `NativeLayerStep`."""

    fallback: object = None  # NativeLayerStep's: what ran instead of Inductor (nothing here)
    runs_head = False  # the head is the model's: its vocabulary stretch, then the gather

    def __init__(self) -> None:
        self._layers: list[tuple[tuple[Any, ...], Tensor | None]] | None = None
        self._cache: KVCache | None = None
        self._model: TensorParallelDecoder | None = None

    @staticmethod
    def for_model(model: Any) -> TensorParallelLayerStep | None:
        """The step for a rank's `model` when qkv's kernels run all its layers (checked on a
        one-row static cache), else None."""
        if not native_kernels().available or not isinstance(model, TensorParallelDecoder):
            return None
        probe = TensorParallelLayerStep()
        probe.bind(model, [StaticKVCache(spec) for spec in model.cache_specs(1, 1)])
        return TensorParallelLayerStep() if probe.bound else None

    @property
    def bound(self) -> bool:
        return self._layers is not None

    def bound_to(self, model: Any, caches: list[KVCache]) -> TensorParallelLayerStep | None:
        step = TensorParallelLayerStep()
        step.bind(model, caches)
        return step if step.bound else None

    def bind(self, model: TensorParallelDecoder, caches: list[KVCache]) -> None:
        self._layers = None
        if any(l.attention.qk_norm is not None and l.attention.qk_norm_over == "all" for l in model.rank_spec.layers):
            return  # OLMo 2: the norm's statistic is all-reduced inside the attention (SplitRMSNorm)
        if any(m.qkv_proj is None for m in model.attention_layers()):
            return  # not prepared (q/k/v unstacked): the modules run
        layers = []
        for part, spec, cache in zip(model.rank_layer_parts(), model.layer_specs(), caches):
            buffers = cache_buffers(cache)
            arguments = None if buffers is None else layer_arguments(part, spec, buffers)
            if arguments is None:
                return
            layers.append(arguments)
        if len(layers) != len(model.model.layers) or not layers:
            return
        self._layers, self._cache, self._model = layers, caches[0], model

    def takes(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> bool:
        return (self._layers is not None and mask is None and x.shape[1] == 1 and x.dtype == torch.float32
                and x.device.type == "cpu" and not torch.is_grad_enabled() and positions.numel() in (1, x.shape[0]))

    def takes_prompts(self) -> bool:
        """Prompts run the modules (their collectives are the modules' own), never these layers."""
        return False

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, 1, C) (the embedding, all-reduced), positions (1,) or (B, 1) -> logits (B, 1, V)."""
        assert self._layers is not None and self._cache is not None and self._model is not None
        model, tp = self._model, self._model.tp
        b, _, c = x.shape
        h = x.reshape(b, c).contiguous()  # (B, C)
        where = positions.reshape(-1).to(torch.int64).expand(b).contiguous()  # (B,)
        rows = self._cache.kernel_rows()  # (B,) cache rows, or None: row r is cache row r
        layer_op = torch.ops.qkv.decoder_layer.default
        for (arguments, ring), layer in zip(self._layers, model.model.layers):
            part = layer_op(h, *arguments, where, rows, ring, ATTENTION_PART)  # (B, C): this rank's partial sum
            part = tp.all_reduce(part, "all-reduce after attention")
            h = h + layer.norm("attn_post_norm", part)  # (B, C)
            part = tp.all_reduce(layer_op(h, *arguments, where, rows, ring, MLP_PART), "all-reduce after the MLP")
            h = h + layer.norm("mlp_post_norm", part)
        return model.head(h.reshape(b, 1, c))  # (B, 1, V)


def _with_layer_step(loaded: LoadedModel, setup: DecodeSetup) -> tuple[LoadedModel, DecodeSetup]:
    return loaded, dataclasses.replace(setup, layer_step=TensorParallelLayerStep.for_model(loaded.model))


def _stored(loaded: LoadedModel, precision: str) -> tuple[LoadedModel, DecodeSetup]:
    place_on_huge_pages(loaded.model)
    kernels = native_kernels()
    if kernels.available:
        register_native_attention()
        use_native_float(loaded.model)  # a slice decoded from blocks it cuts (opened.py): the layer step reads it too
    return _with_layer_step(loaded, DecodeSetup(precision=precision, compile=None, kernels=kernels))


def resolved_precision(rank: RankOpened, precision: str) -> str:
    """What `precision` stands for on this rank's file ("auto" as one process resolves it)."""
    check_precision(precision)
    source = rank.source
    return resolve_precision(precision, stored_in_four_bits=source.stored_in_four_bits,
                             stored_in_blocks=source.stored_in_blocks and block_products_run())


def prepare_rank(rank: RankOpened, precision: str = AUTO) -> tuple[LoadedModel, DecodeSetup]:
    """This rank's decoder at `precision`, ready to decode (module docstring)."""
    resolved = resolved_precision(rank, precision)
    if resolved == BLOCKS:
        loaded = load_stored_blocks(rank) if rank.source.stored_in_blocks else None  # type: ignore[arg-type]
        if loaded is None:
            raise QkvError(f"--dtype blocks needs a GGUF file whose layer matrices are stored in blocks (Q4_K, Q8_0...); "
                           f"{rank.path} is not one: choose {AUTO}, int8 or int4")
        return _stored(loaded, BLOCKS)
    if resolved == "int4" and rank.source.stored_in_four_bits:
        loaded = load_stored_four_bits(rank, _empty_int4)  # type: ignore[arg-type]
        if loaded is not None:
            return _stored(loaded, resolved)
    loaded = rank.build()
    return _with_layer_step(loaded, prepare_for_decoding(loaded.model, precision=resolved, compile=False))
