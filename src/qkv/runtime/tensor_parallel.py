"""One rank of a tensor-parallel decoder, prepared at a precision the way a whole model is.

    rank = open_rank(open_model(path, ...), join_tensor_parallel(N))     # qkv.models.tensor_parallel
    loaded, setup = prepare_rank(rank, "auto")

The rank's slices go through the same loaders as a whole file: "blocks" keeps the slices of a
GGUF file's block matrices as stored (`load_stored_blocks`), int4 on a Q4_0/Q4_1 file takes
their blocks byte for byte (`load_stored_four_bits`), and every other precision builds the
rank's float slices and prepares them with `prepare_for_decoding` (stacking, int8/int4
quantization, float kernels). Never compiled: the all-reduces hang on the modules as hooks,
and a hooked model decodes through its modules (qkv.runtime.session), so neither the
whole-layer native step nor Inductor's graphs run on a rank. No prepared-weights cache either:
a rank's slice is not the file's model.

Shape legend: none (whole modules).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.attention.stacking import stack_projections
from qkv.errors import QkvError
from qkv.names import AUTO, BLOCKS, resolve_precision
from qkv.runtime.huge_pages import place_on_huge_pages
from qkv.runtime.linear.quantized import activation_dtype, quantize
from qkv.runtime.native import native_kernels
from qkv.runtime.native_attention import register_native_attention
from qkv.runtime.prepare import DecodeSetup, block_products_run, check_precision, prepare_for_decoding
from qkv.runtime.stored_blocks import load_stored_blocks
from qkv.runtime.stored_four_bits import load_stored_four_bits

if TYPE_CHECKING:
    from torch import nn

    from qkv.models.loader import LoadedModel
    from qkv.models.tensor_parallel.opened import RankOpened


def _empty_int4(model: nn.Module) -> None:
    """The rank's int4 layers made empty, for the file's blocks assigned next."""
    model.eval()
    stack_projections(model)
    quantize(model, "int4", empty=True)
    model.to(activation_dtype())


def _stored(loaded: LoadedModel, precision: str) -> tuple[LoadedModel, DecodeSetup]:
    place_on_huge_pages(loaded.model)
    kernels = native_kernels()
    if kernels.available:
        register_native_attention()
    return loaded, DecodeSetup(precision=precision, compile=None, kernels=kernels)


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
    return loaded, prepare_for_decoding(loaded.model, precision=resolved, compile=False)
