"""The default decode precision: int4 for a checkpoint whose layers are stored in 4-bit blocks
(SmolLM2's Q4_1 file), int8 for every other (a float checkpoint folder); explicit precisions
stand for themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.models.gguf.checkpoint import open_gguf_file
from qkv.runtime.linear.block import BlockLinear, native_reason
from qkv.runtime.linear.quantized import Int4Linear, Int8Linear
from qkv.names import AUTO, DEFAULT_PRECISION, PRECISIONS, resolve_precision


def test_auto_is_the_default_and_resolves_by_how_the_weights_were_stored() -> None:
    assert DEFAULT_PRECISION == AUTO
    assert resolve_precision(AUTO, stored_in_four_bits=True) == "int4"
    assert resolve_precision(AUTO, stored_in_four_bits=False) == "int8"
    for precision in PRECISIONS:
        assert resolve_precision(precision, stored_in_four_bits=True) == precision


def test_smollm2_is_stored_in_four_bit_blocks(smollm2_file: Path) -> None:
    assert open_gguf_file(smollm2_file).stored_in_four_bits


def test_a_float_checkpoint_folder_decodes_in_int8_by_default(tiny_chat_folder: Path) -> None:
    from qkv.runtime.prepare import load_for_generation

    model, _, setup = load_for_generation(tiny_chat_folder, compile=False)
    assert setup.precision == "int8" and not model.stored_in_four_bits
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert any(isinstance(m, Int8Linear) for m in model.modules())


@pytest.mark.xdist_group("smollm2")
def test_smollm2_decodes_in_int4_by_default() -> None:
    from qkv.runtime.prepare import load_for_generation

    model, _, setup = load_for_generation("smollm2", compile=False)
    assert setup.precision == "int4" and model.stored_in_four_bits
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert sum(isinstance(m, Int4Linear) for m in layers) == 30 * 4  # stacked qkv, o, gate_up, down
    # the head stays at 8 bits: the file's own Q8_0 blocks where qkv's block products run, else int8
    assert isinstance(model.lm_head, BlockLinear if native_reason() is None else Int8Linear)
