"""The one way weights become a decodable model, shared by `qkv generate`, `qkv chat`,
`qkv serve`, `qkv perplexity`, `qkv explain`, `qkv bench` and the Python API:

    prepared = prepare("smollm2", "auto")          # PreparedModel: .model, .tokenizer, .setup
    model, tokenizer, setup = load_for_generation("smollm2")             # the same, as a tuple
    setup = prepare_for_decoding(model, precision="int8", compile=True)   # a model in memory, in place

Precisions (the weights, and the activations they run with):
- "float32": the exact path, the checkpoint's numbers;
- "bfloat16": weights and activations in bfloat16;
- "int8": weight-only int8, one scale per output row (`qkv.runtime.linear.quantized`);
- "int4": weight-only 4-bit blocks of 32 inputs (GGUF's Q4_1 layout);
- "blocks": a GGUF file's layers in the block types it stores (Q4_K, Q6_K, Q5_0, Q8_0...,
  IQ4_NL, IQ4_XS, the IQ1/IQ2/IQ3 grid types, or F16 / BF16 kept in their 16 bits), multiplied as stored (`qkv.runtime.stored_blocks`;
  Q4_K, Q5_K, Q8_0, Q5_0 and IQ4_XS rows repacked at load, losslessly: `qkv.runtime.native.repacked`);
  only from the file itself.
The quantized ones run float32 activations on qkv's own kernels (`qkv.runtime.native`, built for
the machine on first use), or the same math in PyTorch where qkv's cannot be built.

DEFAULT_PRECISION (qkv.names) is "auto": int4 for a checkpoint stored in 4-bit blocks,
"blocks" for a GGUF file in other block types (where qkv's block products run), else int8,
the fastest whose perplexity on the-verdict stays within 1% of bfloat16's
(benchmarks/RESULTS.md).

Every precision first stacks the projections that read the same input (query, key and
value; a SwiGLU's gate and up) into one layer each (`qkv.attention.stacking`): the same numbers in
fewer matrix products. With "float32", decode-sized products then run on qkv's float32
kernel (`qkv.runtime.linear.float`); where it cannot be built, layers with at least as many
outputs as inputs are stored input-major (`qkv.runtime.linear.transposed`), which PyTorch reads
faster at batch 1.

compile=True compiles the decode step. Where qkv's kernels run every layer of a float32 or
quantized model, each layer's decode step is one call of qkv's compiled C++
(`qkv.runtime.layer_step`: about 1 ms of overhead a step, against 14 ms for Inductor's
regions), and Inductor compiles the layers only if a session uses a cache kind those
calls cannot write (`qkv.runtime.compile`, then). Elsewhere each repeated layer is compiled
once with Inductor; where compiling is not possible the model stays eager and the report
says why. compile=False runs the layers as PyTorch modules (the reference path).
`qkv.generation.warm_up` runs the compilation before a timed or interactive generation, so
the first token a user waits for, or a tokens/s figure, does not include it.

How a model was prepared is a value, the `DecodeSetup` these functions return (held with
the model by a `PreparedModel`); a decode session given it (`DecodeSession(model, setup=...)`,
`qkv.generate(..., setup=...)`) binds its native layers to its own caches. The model holds no
fast path, and nothing remembers it on the side. Either way the large weights end on 2 MB
pages (`qkv.runtime.huge_pages`). Loading through `prepare` keeps a model prepared at int8 or
int4 on disk, and the next load assigns it instead of preparing again
(`qkv.runtime.prepared_cache`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qkv.errors import QkvError
from qkv.util.progress import slow_step
from qkv.attention.stacking import stack_projections
from qkv.models.decoder import CausalDecoder
from qkv.runtime.native import NativeStatus, native_kernels
from qkv.runtime.native_attention import register_native_attention
from qkv.runtime.layer_step import NativeLayerStep
from qkv.runtime.stored_blocks import load_stored_blocks
from qkv.runtime.stored_four_bits import load_stored_four_bits
from qkv.runtime.compile import CompilerBackend, CompileReport, compile_decoder
from qkv.runtime.huge_pages import place_on_huge_pages
from qkv.runtime.prepared_cache import check_entry, keep_prepared, prepared_path, read_prepared, reject
from qkv.runtime.linear.quantized import activation_dtype, quantize
from qkv.runtime.linear.float import use_native_float
from qkv.runtime.linear.transposed import store_input_major
from qkv.names import AUTO, BLOCKS, CHOICES, DEFAULT_PRECISION, QUANTIZED, resolve_precision

if TYPE_CHECKING:
    from pathlib import Path

    from qkv.models.loader import LoadedModel, OpenedModel



def block_products_run() -> bool:
    """Whether qkv's native block products run here (else "auto" does not pick "blocks": the
    torch reference would hold float32 weights beside the blocks)."""
    from qkv.runtime.linear.block import native_reason

    return native_reason() is None


def load_dtype(precision: str) -> torch.dtype:
    """The dtype to load weights in for `precision` (quantized ones start from float32)."""
    check_precision(precision)
    return torch.bfloat16 if precision == "bfloat16" else torch.float32


def check_precision(precision: str) -> None:
    if precision not in CHOICES:
        raise QkvError(f"unknown precision {precision!r}; choose one of {', '.join(CHOICES)}")


@dataclass(frozen=True)
class DecodeSetup:
    """How a model was prepared: its precision and what compiling did."""

    precision: str
    compile: CompileReport | None  # Inductor's, None when it was not asked for (or not yet)
    kernels: NativeStatus | None = None  # for quantized precisions: qkv's kernels or why not
    layer_step: NativeLayerStep | None = None  # decode steps as qkv's whole-layer calls (qkv.runtime.layer_step)
    from_cache: bool = False  # the prepared weights came from qkv.runtime.prepared_cache

    @property
    def compiled(self) -> bool:
        return self.layer_step is not None or (self.compile is not None and self.compile.compiled)

    def describe(self) -> str:
        how = "layer step" if self.layer_step is not None else "compiled" if self.compiled else "eager"
        parts = [self.precision, how]
        if self.kernels is not None:
            parts.append(self.kernels.describe())
        return ", ".join(parts)


def prepare_for_decoding(
    model: CausalDecoder,
    *,
    precision: str = DEFAULT_PRECISION,
    compile: bool = True,
    backend: CompilerBackend = "inductor",
    inductor: bool = True,
) -> DecodeSetup:
    """Bring `model` to `precision` and compile it, in place (see the module docstring).
    "auto" is int4 for a model loaded from 4-bit blocks, else int8 (qkv.names).
    inductor=False: qkv's native layers where they run, never Inductor's graphs (a server,
    whose batch sizes vary, would compile one graph per size)."""
    check_precision(precision)
    precision = resolve_precision(precision, stored_in_four_bits=model.stored_in_four_bits)
    if precision == BLOCKS:
        raise QkvError("the blocks precision keeps a GGUF file's own blocks, which a loaded model no longer has: "
                       "load the file with load_for_generation(path, precision='blocks')")
    _shape_layers(model, precision)
    return _finish(model, precision, compile=compile, backend=backend, inductor=inductor)


def _shape_layers(model: CausalDecoder, precision: str, *, empty: bool = False) -> None:
    """The prepared layers at `precision` (a resolved one); empty=True makes them without
    computing their weights, for a state assigned next (qkv.runtime.prepared_cache)."""
    model.eval()
    stack_projections(model)  # q/k/v and gate/up: one product each (qkv.attention.stacking)
    if precision in QUANTIZED:
        quantize(model, precision, empty=empty)  # from the weights as loaded (float32 for these precisions)
    elif precision == "float32" and native_kernels().available:
        model.float()
        use_native_float(model)  # qkv's kernel for decode-sized products (qkv.runtime.linear.float)
    elif precision == "float32":
        store_input_major(model)  # wide layers read faster as x @ W at batch 1 (qkv.runtime.linear.transposed)
    if precision in QUANTIZED:
        model.to(activation_dtype())  # float32: qkv's kernels, or their math in PyTorch
    else:
        model.to(torch.float32 if precision == "float32" else torch.bfloat16)


def _finish(model: CausalDecoder, precision: str, *, compile: bool, backend: CompilerBackend = "inductor",
            from_cache: bool = False, inductor: bool = True) -> DecodeSetup:
    """Weights on 2 MB pages, then the layer step or Inductor's regions."""
    kernels = native_kernels() if precision in (*QUANTIZED, BLOCKS, "float32") else None  # a first build says so itself
    with slow_step("getting the decode step ready"):
        place_on_huge_pages(model)  # a decode step streams every weight: 2 MB pages read faster (qkv.runtime.huge_pages)
        # Inductor waits for a session whose cache kind the layer step cannot write.
        on_modules = (lambda: compile_decoder(model, backend=backend)) if inductor else None
        layer_step = NativeLayerStep.for_model(model, on_modules=on_modules) if compile else None
        report = compile_decoder(model, backend=backend) if compile and inductor and layer_step is None else None
    if kernels is not None:
        register_native_attention()  # one-query attention on qkv's kernel (qkv.attention.registry)
    return DecodeSetup(precision=precision, compile=report, kernels=kernels, layer_step=layer_step, from_cache=from_cache)


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for decoding, with what came with it (tokenizer, chat template, path) and
    how it was prepared: what `prepare` gives every entry point."""

    loaded: LoadedModel
    setup: DecodeSetup

    @property
    def model(self) -> CausalDecoder:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer


def load_for_generation(
    source: str | os.PathLike[str],
    *,
    precision: str = DEFAULT_PRECISION,
    compile: bool = True,
    max_memory: int | None = None,
) -> tuple[CausalDecoder, Any, DecodeSetup]:
    """Load a decoder (a checkpoint folder, a .gguf file or 'smollm2') ready for fast
    decoding: (model, tokenizer, setup), as `prepare` makes it; hand `setup` to
    `qkv.generate(..., setup=setup)` so the decode steps run as prepared. A model prepared at a
    quantized precision is kept on disk and the next load assigns it instead of preparing
    again (qkv.runtime.prepared_cache; setup.from_cache says which happened)."""
    prepared = prepare(source, precision, compile=compile, max_memory=max_memory)
    return prepared.model, prepared.tokenizer, prepared.setup


def prepare(
    source: str | os.PathLike[str],
    precision: str = DEFAULT_PRECISION,
    *,
    compile: bool = True,
    inductor: bool = True,
    max_memory: int | None = None,
    chat: bool = False,
) -> PreparedModel:
    """The one way a source (a checkpoint folder, a .gguf file, a packaged name) becomes a
    decodable model, for every command, the server and the Python API. "auto" and "blocks"
    keep a GGUF file's blocks as stored where qkv's block products run; int4 takes Q4_0/Q4_1
    blocks byte for byte; int8 and int4 otherwise come from the prepared-weights cache, or are
    made from the weights and kept there. chat: the model must come with a chat template.
    inductor=False: never Inductor's graphs (a server, whose batch sizes vary)."""
    from qkv.models.loader import open_model

    check_precision(precision)
    keep_blocks = precision == BLOCKS or (precision == AUTO and block_products_run())  # sized as stored
    with slow_step(f"opening {os.fspath(source)}"):
        opened = open_model(source, load_dtype(precision), max_memory=max_memory, chat=chat, keep_blocks=keep_blocks)
    if precision == AUTO and getattr(opened.source, "prefers_float32", False):
        precision = "float32"  # the book's model.pth: its own float32 greedy text is the reference
    in_blocks = getattr(opened.source, "stored_in_blocks", False)
    asked = precision
    precision = resolve_precision(precision, stored_in_four_bits=getattr(opened.source, "stored_in_four_bits", False),
                                  stored_in_blocks=in_blocks and block_products_run())
    finish = functools.partial(_finish, compile=compile, inductor=inductor)
    if precision == BLOCKS:  # a GGUF file's layers in its own block types (stored_blocks)
        with slow_step("loading the file's stored blocks"):
            blocks = load_stored_blocks(opened) if in_blocks else None
        if blocks is not None:
            return PreparedModel(blocks, finish(blocks.model, precision))
        if asked == BLOCKS:
            raise QkvError(f"--dtype blocks needs a GGUF file whose layer matrices qkv's models hold as stored "
                           f"blocks (Q4_K, Q8_0, F16...); {opened.source.path} is not one: choose {AUTO}, int8 or int4")
        precision = "int8"  # a model whose layers are not the file's matrices one for one (GPT-2's Conv1D)
        with slow_step(f"opening {os.fspath(source)} for int8"):
            opened = open_model(source, load_dtype(precision), max_memory=max_memory, chat=chat)  # sized as float32
    if precision == "int4":  # a file of Q4_0/Q4_1 layers: its blocks as stored, no cache needed (stored_four_bits)
        with slow_step("loading the file's stored 4-bit blocks"):
            stored = load_stored_four_bits(opened, lambda model: _shape_layers(model, precision, empty=True))
        if stored is not None:
            return PreparedModel(stored, finish(stored.model, precision))
    kept = (prepared_path(opened.files, precision)
            if precision in QUANTIZED and native_kernels().available else None)
    cached = _from_cache(opened, precision, kept) if kept is not None else None
    if cached is not None:
        return PreparedModel(cached, finish(cached.model, precision, from_cache=True))
    with slow_step("loading the weights"):
        loaded = opened.build()
    with slow_step(f"preparing the {precision} weights" + (" (kept in the cache for the next run)" if kept else "")):
        _shape_layers(loaded.model, precision)
    if kept is not None:
        with slow_step("keeping the prepared weights in the cache"):
            keep_prepared(loaded.model, kept)
    return PreparedModel(loaded, finish(loaded.model, precision))


def _from_cache(opened: OpenedModel, precision: str, kept: Path) -> LoadedModel | None:
    """The model with its prepared weights assigned from the cache entry `kept`; None when
    there is none or it is damaged (then rejected, and the caller prepares afresh)."""
    with slow_step(f"reading the prepared {precision} weights from the cache and checking their digest"):
        state = read_prepared(kept)
        if state is None:
            return None
        loaded = opened.skeleton()
        _shape_layers(loaded.model, precision, empty=True)
        damage = check_entry(state, loaded.model.state_dict())
        if damage is None:
            try:
                loaded.model.load_state_dict(state, assign=True, strict=True)
            except (RuntimeError, ValueError) as error:  # written by another qkv: prepare afresh
                damage = str(error).splitlines()[0][:120]
    if damage is not None:
        reject(kept, damage)
        return None
    return loaded
