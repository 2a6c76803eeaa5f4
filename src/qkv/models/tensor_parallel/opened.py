"""A model opened for one rank: the whole file's checks (qkv.models.loader.open_model, headers
only), then this rank's slice of every tensor, read straight from the file.

`open_rank(opened, tp)` gives a `RankOpened`, which answers what the preparation path asks of
an `OpenedModel`: `skeleton()` (the rank's `TensorParallelDecoder`, parameters on the meta
device), `build()` (with its float slices), `source.read_stored(...)` (its slices kept in
blocks where the file stores blocks, as `qkv.models.gguf.stored.read_stored_state` gives the
whole file's), `source.read_tensors(...)`, `plan.dtype`, `source.stored_in_blocks` and
`source.stored_in_four_bits`. So the stored-blocks and stored-4-bit loaders of the runtime
prepare a rank's slice exactly as they prepare a whole model (qkv.runtime.tensor_parallel).

Shape legend: R rows, K columns, V vocabulary, C hidden size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.models.gguf import arch as gguf_arch
from qkv.models.gguf import checkpoint as gguf
from qkv.models.gguf import dequantize as gguf_blocks
from qkv.models.gguf.layout import rope_heads
from qkv.models.gguf.stored import StoredBlocks, StoredState, is_projection
from qkv.models.hf.checkpoint import config_value, eos_ids
from qkv.models.key_maps.spec import spec_shapes
from qkv.models.loader import LoadedModel, OpenedModel
from qkv.models.spec_decoder import SpecDecoder
from qkv.models.tensor_parallel.assignment import RankShare, shares
from qkv.models.tensor_parallel.decoder import TensorParallelDecoder, rank_spec
from qkv.models.tensor_parallel.group import TensorParallel
from qkv.models.tensor_parallel.slices import GGUFSlices, TensorSlice, read_safetensors_slice
from qkv.util.empty_init import parameters_on_meta

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)")
_STACKABLE = re.compile(r"(model\.layers\.(\d+)\.)(?:self_attn\.([qkv])_proj|mlp\.(gate|up)_proj)\.(weight|bias)")


@dataclass(frozen=True)
class Part:
    """What a rank reads of one tensor: a slice, or nothing (zeros: a row-parallel bias off rank 0)."""

    slice: TensorSlice
    zeros: bool = False


def stored_as(name: str, spec: Any) -> tuple[str, int]:
    """The checkpoint tensor that holds the model's tensor `name`, and the row where `name`'s
    rows begin in it: itself at row 0, but Phi-3 stores q/k/v stacked as self_attn.qkv_proj
    (queries, keys, values) and gate/up as mlp.gate_up_proj (gate, up), so a rank's q, k, v,
    gate and up rows are each one stretch of rows of the stacked tensor."""
    match = _STACKABLE.fullmatch(name)
    if match is None:
        return name, 0
    prefix, index, qkv, gate_up, kind = match.groups()
    layer = spec.layers[int(index)]
    if qkv is not None and spec.stacked_qkv:
        a = layer.attention
        queries, keys = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return f"{prefix}self_attn.qkv_proj.{kind}", {"q": 0, "k": queries, "v": queries + keys}[qkv]
    if gate_up is not None and spec.stacked_gate_up:
        return f"{prefix}mlp.gate_up_proj.{kind}", 0 if gate_up == "gate" else layer.mlp.intermediate_size
    return name, 0


def _shifted(part: Part, rows: int) -> Part:
    if rows == 0 or part.slice.rows is None:
        return part
    held = part.slice.rows
    return Part(TensorSlice(range(held.start + rows, held.stop + rows), part.slice.cols), part.zeros)


def part_of(name: str, share: RankShare, *, qk_norm_over_all: bool = False) -> Part:
    """Rank `share.rank`'s part of the checkpoint tensor `name` (qkv.models.tensor_parallel.decoder);
    qk_norm_over_all: the q/k norms span every head (OLMo 2), so a rank holds its heads' channels."""
    if name in (EMBEDDING, HEAD):
        return Part(TensorSlice(rows=share.vocabulary))
    match = _LAYER.fullmatch(name)
    if match is None:
        return Part(TensorSlice())  # norms: every rank holds them whole
    module, kind = match.group(2), match.group(3)
    if module == "q_proj":
        return Part(TensorSlice(rows=share.query_rows))
    if module in ("k_proj", "v_proj"):
        return Part(TensorSlice(rows=share.kv_rows))
    if module in ("gate_proj", "up_proj"):
        return Part(TensorSlice(rows=share.features))
    if module in ("o_proj", "down_proj"):
        if kind == "bias":  # added once, after the sum: rank 0's
            return Part(TensorSlice(), zeros=share.rank != 0)
        return Part(TensorSlice(cols=share.query_rows if module == "o_proj" else share.features))
    if qk_norm_over_all and module in ("q_norm", "k_norm"):
        return Part(TensorSlice(rows=share.query_rows if module == "q_norm" else share.kv_rows))
    return Part(TensorSlice())  # per-head q/k norms


def whole_spec(opened: OpenedModel) -> tuple[Any, Any]:
    """(DecoderSpec, the family's config) of the opened model, or QkvError for a model that
    tensor parallelism does not split."""
    skeleton = opened.plan.skeleton()  # parameters on the meta device: nothing allocated
    where = str(opened.path)
    if not isinstance(skeleton, SpecDecoder):
        raise QkvError(f"{where}: tensor parallelism splits the decoders described by a layer spec (Llama, Qwen, "
                       f"Mistral, Gemma, OLMo 2, SmolLM3), not {type(skeleton).__name__}")
    return skeleton.spec, skeleton.cfg


class RankSource:
    """This rank's slices of a GGUF file or checkpoint folder (module docstring)."""

    def __init__(self, opened: OpenedModel, spec: Any, share: RankShare) -> None:
        self.opened, self.spec, self.share = opened, spec, share
        self.whole = opened.source
        self.path = Path(self.whole.path)
        self.tokenizer = self.whole.tokenizer
        self.local_shapes = spec_shapes(rank_spec(spec, share))
        self.decoded: list[str] = []  # block matrices whose slice cuts through blocks: held as float32

    @property
    def stored_in_blocks(self) -> bool:
        return bool(getattr(self.whole, "stored_in_blocks", False))

    @property
    def stored_in_four_bits(self) -> bool:
        return bool(getattr(self.whole, "stored_in_four_bits", False))

    def names(self) -> list[str]:
        """The model's tensor names, the tied head left out (it is the embedding's rows)."""
        return [n for n in spec_shapes(self.spec) if not (n == HEAD and self.spec.tie_word_embeddings)]

    def _part(self, name: str) -> Part:
        return part_of(name, self.share, qk_norm_over_all=any(
            l.attention.qk_norm is not None and l.attention.qk_norm_over == "all" for l in self.spec.layers))

    def _check(self, name: str, value: Tensor | StoredBlocks) -> None:
        shape = tuple(value.shape)
        wanted = self.local_shapes[name]
        if shape != wanted:  # the assignment and the reader disagree: a bug, not bad input
            raise AssertionError(f"rank {self.share.rank}: {name} read as {shape}, its slice is {wanted}")

    def read_stored(self, dtype: torch.dtype = torch.float32, *, embedding: bool = False) -> StoredState:
        """This rank's tensors: projections (and with `embedding`, the embedding table) in blocks
        where the file stores blocks and the slice is whole blocks, the rest as `dtype` values."""
        keep = (lambda name: is_projection(name) or name == EMBEDDING) if embedding else is_projection
        return self._read(dtype, keep)

    def read_tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        state = self._read(dtype, lambda name: False).state
        if self.spec.tie_word_embeddings:
            state[HEAD] = state[EMBEDDING]
        return state

    def _read(self, dtype: torch.dtype, keep: Any) -> StoredState:
        if isinstance(self.whole, gguf.GGUFFile):
            return self._read_gguf(dtype, keep)
        return StoredState(self._read_folder(dtype), {})

    def _read_folder(self, dtype: torch.dtype) -> dict[str, Tensor]:
        rename = self.opened.plan.family.rename(self.whole.shapes)
        stored_names = {rename(k): k for k in self.whole.shapes}
        state: dict[str, Tensor] = {}
        for name in self.names():
            source, rows = stored_as(name, self.spec)
            part = _shifted(self._part(name), rows)
            file_name = stored_names.get(source)
            if file_name is None:
                raise QkvError(f"{self.path}: lacks {name}")
            if part.zeros:
                state[name] = torch.zeros(self.local_shapes[name], dtype=dtype)
                continue
            value = read_safetensors_slice(self.whole.entries[file_name].file, file_name, part.slice)
            if not bool(torch.isfinite(value).all()):
                raise QkvError(f"{self.path}: weight {name} holds NaN or infinite values; the checkpoint is corrupt")
            self._check(name, value)
            state[name] = value.to(dtype).contiguous()
        return state

    def _read_gguf(self, dtype: torch.dtype, keep: Any) -> StoredState:
        file: gguf.GGUFFile = self.whole
        arch = gguf_arch.architecture(file.reader, self.path)
        by_name = {arch.hf_name(t.name): t for t in arch.weights(file.reader.tensors)}
        tied = self.spec.tie_word_embeddings
        state: dict[str, Tensor] = {}
        blocks: dict[str, StoredBlocks] = {}
        reader = GGUFSlices(self.path)
        self.decoded = []
        try:
            for name in self.names():
                source, rows = stored_as(name, self.spec)
                part = _shifted(self._part(name), rows)
                if part.zeros:
                    state[name] = torch.zeros(self.local_shapes[name], dtype=dtype)
                    continue
                tensor = by_name[source]
                heads = rope_heads(name, file.config, arch)
                if heads is not None:  # the slice's own heads, reordered within each
                    heads = len(self.share.query_heads if "q_proj" in name else self.share.kv_heads)
                shift = arch.norm_shift if arch.is_shifted_norm(tensor.name) else 0.0
                head_too = tied and name == EMBEDDING and keep(HEAD)
                value = reader.read(tensor, part.slice, keep_blocks=keep(name) or head_too, rope_heads=heads, shift=shift)
                self._check(name, value)
                if isinstance(value, StoredBlocks):
                    if head_too:
                        blocks[HEAD] = value
                    if keep(name):
                        blocks[name] = value
                    else:
                        state[name] = value.dequantize(dtype)
                else:
                    if keep(name) and tensor.tensor_type in gguf_blocks.BLOCK_FORMATS:
                        self.decoded.append(name)
                    state[name] = value.to(dtype)
        finally:
            reader.close()
        return StoredState(state, blocks)


@dataclass
class RankOpened:
    """An `OpenedModel` for one rank (module docstring)."""

    opened: OpenedModel
    tp: TensorParallel
    share: RankShare
    spec: Any  # DecoderSpec of the whole model
    cfg: Any
    source: RankSource

    @property
    def plan(self) -> Any:
        return self.opened.plan

    @property
    def path(self) -> Path:
        return self.opened.path

    @property
    def files(self) -> list[Path]:
        return self.opened.files

    def skeleton(self) -> LoadedModel:
        """The rank's decoder with its parameters on the meta device."""
        with parameters_on_meta():
            model = TensorParallelDecoder(self.spec, self.share, self.tp, cfg=self.cfg)
        model.to(self.plan.dtype)
        model.eos_token_ids = eos_ids(config_value(self.plan.config, "eos_token_id"), self.spec.vocab_size)
        model.stored_in_four_bits = self.source.stored_in_four_bits
        folder_eos = getattr(self.opened.source, "generation_eos", None)
        if folder_eos is not None:
            model.eos_token_ids = folder_eos() or model.eos_token_ids
        model.eval()
        return LoadedModel(model, self.source.tokenizer, self.path, self.opened.template)

    def build(self) -> LoadedModel:
        """The rank's decoder with its float slices (read now, in `plan.dtype`)."""
        loaded = self.skeleton()
        state = self.source.read_tensors(self.plan.dtype)
        with torch.no_grad():
            for owner, holder in loaded.model.named_modules():
                for key, parameter in list(holder.named_parameters(recurse=False)):
                    name = f"{owner}.{key}" if owner else key
                    holder.register_parameter(key, nn.Parameter(state[name].to(parameter.dtype), requires_grad=False))
        return loaded


def open_rank(opened: OpenedModel, tp: TensorParallel) -> RankOpened:
    """This rank's view of `opened` (QkvError when the model cannot be split over tp.world ranks)."""
    spec, cfg = whole_spec(opened)
    share = shares(spec, tp.world, str(opened.path))[tp.rank]
    return RankOpened(opened, tp, share, spec, cfg, RankSource(opened, spec, share))
